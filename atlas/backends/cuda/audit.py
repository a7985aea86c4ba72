"""The CUDA backend's digests for the state-digest audit mode (atlas.backends.audit holds the records and checks).

What a ring or prefix snapshot saves, a restore installs and a verify commit selects is a slot's per-slot state
(GDN conv + recurrent, PLE short conv and n-gram context) with its stamps: `slot_digest` hashes it, in the
names' order, from the live pools. A verify keeps the state after each of its rows until the commit picks one:
`verify_row_digests` hashes, for rows 1 .. K, exactly what `DevicePools.inter_load` would install for that row
(the row-by-row copies in `inter`, or a wide verify's `kept` per-token tensors cast to the state's dtype, the
states it does not keep as they are), so a commit that installs anything else differs from its row's digest.
Recorded from the live slot at snapshot time (what the snapshot must hold), a snapshot that saved the wrong
bytes is caught at its restore as well as a restore that brought back the wrong ones.
"""

from __future__ import annotations

import torch

from atlas.backends.audit import Parts, parts
from atlas.backends.cuda.pools import DevicePools


def _digest(names: tuple[str, ...], states: list[torch.Tensor], stamps: torch.Tensor) -> Parts:
    return parts([*zip(names, states, strict=True), ("stamps", stamps.to(torch.int32))])


def slot_digest(pools: DevicePools, slot: int) -> Parts:
    """The slot's live per-slot state and stamps."""
    return _digest(pools.names, [pools.state[n][slot] for n in pools.names], pools.stamps[:, slot])


def verify_row_digests(pools: DevicePools, slot: int, width: int) -> tuple[Parts, ...]:
    """For rows = 1 .. width: the digest of the state a commit of `rows` rows installs at `slot`."""
    out = []
    for r in range(1, width + 1):
        if pools.kept:  # a wide verify: the kept per-token tensors, the rest untouched
            states, stamps = [], []
            for i, n in enumerate(pools.names):
                if n in pools.kept:
                    per_token, kstamps, kslots = pools.kept[n]
                    b = int((kslots == slot).nonzero()[0, 0])
                    states.append(per_token[r - 1, b].to(pools.state[n].dtype))
                    stamps.append(kstamps[r - 1, b].to(torch.int32))
                else:
                    states.append(pools.state[n][slot])
                    stamps.append(pools.stamps[i, slot])
            out.append(_digest(pools.names, states, torch.stack(stamps) if stamps else pools.stamps[:, slot]))
        else:  # row by row: inter[r] holds the state after row r
            out.append(_digest(pools.names, [pools.inter[n][r, slot] for n in pools.names],
                               pools.inter_stamps[r][:, slot]))
    return tuple(out)
