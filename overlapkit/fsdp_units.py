"""The flat-parameter sharding of fully sharded data parallelism: what a unit is.

Which parameters form which unit (the submodules given, the rest the root unit; a parameter
shared by two units, a unit of mixed dtypes, a container never called: refused), and a
unit's parameters as one flat buffer, 1/N of it a shard per rank, whose views stand in the
modules where the parameters were. ``ok.FullyShardedDP`` (:mod:`overlapkit.fsdp`) gathers
and frees that buffer around each unit's compute.
"""

from __future__ import annotations

import torch


class _Unit:
    """One unit's parameters: a flat shard per rank, and the whole (when gathered) as a
    flat buffer whose views stand in the modules where the parameters were."""

    def __init__(self, index: int, name: str, module, slots, world: int, rank: int):
        self.index, self.name, self.module = index, name, module
        self.names = [names for _, names, _ in slots]  # a tied parameter has several
        params = [p for p, _, _ in slots]
        self.shapes = [p.shape for p in params]
        self.numels = [p.numel() for p in params]
        self.offsets = [sum(self.numels[:i]) for i in range(len(params))]
        total = sum(self.numels)
        self.shard_numel = -(-total // world)  # ceil: the last shard is padded with zeros
        self.padded = self.shard_numel * world
        first = params[0]
        self.trainable = first.requires_grad
        self.element_size = first.element_size()
        self.full = torch.zeros(self.padded, dtype=first.dtype, device=first.device)
        with torch.no_grad():
            for p, o, n in zip(params, self.offsets, self.numels, strict=True):
                self.full[o : o + n].copy_(p.reshape(-1))
        self.rank = rank
        self.shard = None  # made after the broadcast
        # the leaves autograd sees: views of the flat buffer, each its own leaf (so each
        # gets its own .grad). `.data` gives them a version counter apart from the buffer's:
        # refilling the buffer before backward is not an in-place change autograd objects to
        alias = self.full.data
        spans = zip(self.offsets, self.numels, self.shapes, strict=True)
        self.leaves = [alias[o : o + n].view(s).requires_grad_(self.trainable)
                       for o, n, s in spans]  # fmt: skip
        self.owners = [owners for _, _, owners in slots]
        self.gathered = True
        self.counted = False  # its whole bytes are in the wrapper's count of what is held
        self.pending = None  # the AllGather in flight
        self.ready = 0  # leaves whose gradient is complete this backward
        self.complete = False
        self.launched = False
        self.backward_started = False

    @property
    def bytes(self) -> int:
        return self.padded * self.element_size

    def make_shard(self) -> torch.nn.Parameter:
        lo = self.rank * self.shard_numel
        self.shard = torch.nn.Parameter(self.full[lo : lo + self.shard_numel].clone(),
                                        requires_grad=self.trainable)  # fmt: skip
        return self.shard


def _resolve_units(model: torch.nn.Module, units) -> list:
    """(name, submodule) of each unit: ``units`` as modules or their names (default,
    each direct child that has parameters), each one the model's own and ever called."""
    inner = dict(model.named_modules())
    by_id = {id(m): n for n, m in inner.items()}
    if units is None:
        units = [m for _, m in model.named_children()
                 if next(m.parameters(), None) is not None]  # fmt: skip
    resolved = []
    for i, u in enumerate(units):
        if isinstance(u, str):
            if u not in inner or u == "":
                raise ValueError(
                    f"FullyShardedDP: unit #{i} {u!r} names no submodule of the model; "
                    f"its submodules: {', '.join(repr(n) for n in inner if n)[:300]}"
                )
            u = inner[u]
        if not isinstance(u, torch.nn.Module) or id(u) not in by_id:
            raise ValueError(
                f"FullyShardedDP: unit #{i} ({type(u).__name__}) is not a submodule of the "
                "model being wrapped: pass modules from inside it (or their names)"
            )
        if u is model:
            raise ValueError(
                "FullyShardedDP: the whole model cannot be a unit: its parameters outside "
                "every unit already form the root unit; pass its blocks"
            )
        if type(u).forward is torch.nn.Module.forward:  # ModuleList, ModuleDict
            raise ValueError(
                f"FullyShardedDP: unit {by_id[id(u)]!r} is a {type(u).__name__}, which is "
                "never called: its hooks would not run and its parameters would be used "
                "without being gathered. Make each module it holds a unit, or wrap them "
                "in one module whose forward calls them"
            )
        resolved.append((by_id[id(u)], u))
    return resolved


def _make_units(model: torch.nn.Module, unit_modules, world: int, rank: int) -> list[_Unit]:
    """Every parameter to the one unit whose subtree owns it (else the root unit)."""
    owner_unit = {}
    for name, m in unit_modules:
        for sub in m.modules():
            if id(sub) in owner_unit and owner_unit[id(sub)] != name:
                raise ValueError(
                    f"FullyShardedDP: units {owner_unit[id(sub)]!r} and {name!r} overlap "
                    "(one is inside the other): each parameter belongs to one unit"
                )
            owner_unit[id(sub)] = name
    found: dict[int, list] = {}  # id(param) -> [param, [names], [(module, attr)], unit]
    for mname, m in model.named_modules():
        for attr, p in list(m._parameters.items()):
            if p is None:
                continue
            full = f"{mname}.{attr}" if mname else attr
            unit = owner_unit.get(id(m), "")
            entry = found.setdefault(id(p), [p, [], [], unit])
            if entry[3] != unit:
                raise ValueError(
                    f"FullyShardedDP: parameter {entry[1][0]!r} is also {full!r}, in unit "
                    f"{unit or '(root)'!r} as well as {entry[3] or '(root)'!r}: a parameter "
                    "shared by two units would be gathered and reduced twice; put both "
                    "users in one unit"
                )
            entry[1].append(full)
            entry[2].append((m, attr))
    groups: dict[str, list] = {name: [] for name, _ in unit_modules}
    groups[""] = []
    for p, names, owners, unit in found.values():
        groups[unit].append((p, names, owners))
    units = []
    modules = dict(unit_modules)
    for name, slots in groups.items():
        if not slots:
            continue
        kinds = {(p.dtype, p.requires_grad) for p, _, _ in slots}
        if len(kinds) > 1:
            described = ", ".join(f"{n[0]} ({str(p.dtype).replace('torch.', '')}, "
                                  f"{'trainable' if p.requires_grad else 'frozen'})"
                                  for p, n, _ in slots)  # fmt: skip
            raise ValueError(
                f"FullyShardedDP: unit {name or '(root)'!r} mixes dtypes or frozen and "
                f"trainable parameters: {described[:400]}. A unit is one flat buffer of one "
                "dtype, all trained or all frozen: split it into units"
            )
        units.append(_Unit(len(units), name or "(root)", modules.get(name), slots,
                           world, rank))  # fmt: skip
    for u in units:  # the modules now hold views of the unit's buffer, not parameters
        for leaf, owners in zip(u.leaves, u.owners, strict=True):
            for m, attr in owners:
                del m._parameters[attr]
                setattr(m, attr, leaf)
    return units
