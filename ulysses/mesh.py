"""Device meshes as the Ulysses group: one dimension of a ``DeviceMesh`` is a process group.

Every public function of the package that takes ``group=`` also takes

    * a 1-D ``torch.distributed.device_mesh.DeviceMesh`` (e.g. ``mesh["sp"]``), or
    * a pair ``(mesh, dim)``: a mesh of any number of dimensions and the name (or index) of
      the dimension Ulysses runs over; the other dimensions are free for data parallel, FSDP2
      or tensor parallel.

The mesh dimension becomes that dimension's process group (``mesh.get_group(dim)``); the
rank and world size are this rank's coordinate and the dimension's size. What cannot be one
group raises ValueError naming what to pass instead: a mesh of several dimensions without a
dimension, a dimension the mesh does not have, a mesh that does not contain this rank.

    mesh = init_device_mesh("cuda", (dp, sp), mesh_dim_names=("dp", "sp"))
    out = ulysses.ulysses_attention(q, k, v, group=mesh["sp"])        # or group=(mesh, "sp")
"""

from __future__ import annotations

__all__ = ["is_mesh_group", "mesh_group"]


def _device_mesh_type():
    """The DeviceMesh class, or None where torch.distributed (or its mesh) is unavailable."""
    try:
        import torch.distributed as dist

        if not dist.is_available():
            return None
        from torch.distributed.device_mesh import DeviceMesh
    except ImportError:  # a torch build without distributed
        return None
    return DeviceMesh


def is_mesh_group(group) -> bool:
    """True for a ``DeviceMesh`` or a ``(DeviceMesh, dim)`` pair: what :func:`mesh_group`
    turns into a process group."""
    if group is None:
        return False
    mesh_type = _device_mesh_type()
    if mesh_type is None:
        return False
    if isinstance(group, mesh_type):
        return True
    return isinstance(group, tuple) and len(group) == 2 and isinstance(group[0], mesh_type)


def _describe(mesh) -> str:
    names = mesh.mesh_dim_names
    dims = f", dimensions {tuple(names)}" if names else ""
    return f"a DeviceMesh of shape {tuple(mesh.shape)}{dims}"


def mesh_group(group):
    """``DeviceMesh`` (1-D) or ``(mesh, dim)`` -> the process group of that mesh dimension.

    Raises:
        TypeError: ``dim`` neither a str nor an int.
        ValueError: a mesh of several dimensions given without a dimension; a dimension the
            mesh does not name (or an index out of range); a mesh that does not contain this
            process's rank.
    """
    if isinstance(group, tuple):
        mesh, dim = group
        if isinstance(dim, bool) or not isinstance(dim, str | int):
            raise TypeError(
                "group: in (mesh, dim), dim must be a mesh dimension's name (str) or index "
                f"(int), got {type(dim).__name__} {dim!r} (several dimensions as one Ulysses "
                "group: flatten them into one mesh dimension first)"
            )
        names = mesh.mesh_dim_names or ()
        if isinstance(dim, str) and dim not in names:
            raise ValueError(
                f"group: (mesh, {dim!r}): {_describe(mesh)} has no dimension {dim!r}; pass "
                f"one of {tuple(names)}"
            )
        if isinstance(dim, int) and not 0 <= dim < mesh.ndim:
            raise ValueError(
                f"group: (mesh, {dim}): {_describe(mesh)} has dimensions 0..{mesh.ndim - 1}"
            )
    else:
        mesh, dim = group, None
        if mesh.ndim != 1:
            names = mesh.mesh_dim_names
            pick = f"mesh[{names[-1]!r}] or (mesh, {names[-1]!r})" if names else "(mesh, 1)"
            raise ValueError(
                f"group: {_describe(mesh)} is not 1-D; Ulysses runs over one dimension: pass "
                f"that dimension, e.g. group={pick}"
            )
    if mesh.get_coordinate() is None:
        raise ValueError(
            f"group: {_describe(mesh)} over ranks {mesh.mesh.flatten().tolist()} does not "
            "contain this process's rank; pass the mesh (or mesh dimension) this rank belongs to"
        )
    return mesh.get_group(dim) if dim is not None else mesh.get_group()
