"""Where a process sits in a device mesh, FSDP2's HSDP convention: the last dim is the ring,
a first dim (if any) holds the data-parallel replicas."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh


def place_in(mesh: DeviceMesh, world_size: int):
    """(rank, ring group, replicas) of this process in a 1-D or 2-D mesh whose last dim is
    the ring; `replicas`: RankEmitter's replica arguments (none for a 1-D mesh)."""
    if mesh.ndim not in (1, 2):
        raise ValueError(
            f"rtp_compile: a mesh of 1 or 2 dims (replicas, ring) is supported, "
            f"got {mesh.ndim} dims {tuple(mesh.mesh.shape)}; flatten the leading "
            "dims into one"
        )
    if mesh.size(-1) != world_size:
        raise ValueError(
            f"rtp_compile: the mesh's last dim has {mesh.size(-1)} ranks but the "
            f"program was compiled for world_size={world_size}: the last dim "
            "is the ring; transform with its size"
        )
    rank, group = mesh.get_local_rank(mesh.ndim - 1), mesh.get_group(mesh.ndim - 1)
    if mesh.ndim == 1:
        return rank, group, {}
    return (
        rank,
        group,
        {
            "replica": mesh.get_local_rank(0),
            "replicas": mesh.size(0),
            "replica_group_name": mesh.get_group(0).group_name,
        },
    )
