"""Placement plans: which chunks to fetch, prefetch and evict at each access of a recorded step.

Pure functions over names and sizes, tested without a device. `build_plan` evicts by `victim`, Belady's
rule (the resident chunk whose next use is furthest away) made write-back-aware: evicting a chunk
changed on the device costs its write-back and its fetch, a clean one only the fetch, so a dirty chunk
leaves only when its next use is `write_back` times as far (twice, by those costs; the planner also tries
other factors and keeps the one that moves least: planning.WRITE_BACK_FACTORS). Next uses look across the step's end for the chunks that
stay valid into the next step (`carried`), since a steady step starts with what the last one left. The
budget changes from one access to the next (what the non-model data leaves free), and the next access's
chunks are prefetched into room that is already free. `simulate` replays an eviction rule on the same
sequence and counts the bytes a step moves, write-backs included.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Collection, Sequence
from typing import NamedTuple

INFINITY = 1 << 62


class Access(NamedTuple):
    """Chunks needed on the device together at one moment; `writes` are changed there. A tuple: each step makes and
    compares its few hundred (placement's `_same`), which a frozen dataclass's cost 0.5 ms of a launch-bound step."""

    chunks: tuple[str, ...]
    writes: frozenset[str] = frozenset()


@dataclasses.dataclass(frozen=True)
class Action:
    at: int  # index of the access this action prepares
    verb: str  # "evict" | "fetch" | "prefetch"
    chunk: str

    def __str__(self) -> str:
        return f"@{self.at} {self.verb} {self.chunk}"


@dataclasses.dataclass(frozen=True)
class Plan:
    actions: tuple[Action, ...]
    budgets: tuple[int, ...]
    slots: tuple[tuple[int, int], ...] = ()  # (bytes, most chunks of that size resident at once), by size
    def at(self, index: int) -> list[Action]:
        return [a for a in self.actions if a.at == index]

    def __str__(self) -> str:
        return "\n".join(map(str, self.actions))


def next_uses(accesses: Sequence[Access], carried: Collection[str] = ()) -> list[dict[str, int]]:
    """For each access i, the index of the next access (> i) of every chunk used later; a `carried` chunk not
    used again this step is next used at its first access of the next step (index len + first)."""
    first: dict[str, int] = {}
    for i, access in enumerate(accesses):
        for name in access.chunks:
            first.setdefault(name, i)
    later = {name: len(accesses) + i for name, i in first.items() if name in carried}
    table: list[dict[str, int]] = [{}] * len(accesses)
    for i in range(len(accesses) - 1, -1, -1):
        table[i] = dict(later)
        for name in accesses[i].chunks:
            later[name] = i
    return table


def victim(index: int, candidates: Collection[str], nexts: dict[str, int], dirty: Collection[str],
           write_back: float = 2.0) -> str:
    """The chunk to evict before access `index`: furthest next use, a dirty chunk's distance divided by
    `write_back` (its eviction costs a write-back besides the fetch); ties by name, so every rank and every
    replay agrees."""
    def key(name: str) -> tuple[float, str]:
        distance = nexts.get(name, INFINITY) - index
        return (-(distance / write_back if name in dirty else distance), name)
    return min(candidates, key=key)


def build_plan(accesses: Sequence[Access], sizes: dict[str, int], budgets: Sequence[int],
               resident: Collection[str] = (), dirty: Collection[str] = (), carried: Collection[str] = (),
               lending: Collection[str] = (), write_back: float = 2.0) -> Plan:
    """The write-back-aware Belady placement of `accesses` with `budgets[i]` bytes for chunks at access i,
    from `resident` chunks (`dirty` among them changed on the device). Its `slots` count the chunks resident
    at once by size, but for `lending` ones (their bytes are autograd's: chunk.py's Note on lent ranges)."""
    _check_inputs(accesses, sizes, budgets)
    nxt = next_uses(accesses, carried)
    held, changed = set(resident), set(dirty) & set(resident)
    actions: list[Action] = []
    slots = _by_size(held, sizes, lending)
    for i, access in enumerate(accesses):
        needed = set(access.chunks)
        over = sum(sizes[c] for c in held | needed) - budgets[i]
        while over > 0:
            evicted = victim(i, held - needed, nxt[i], changed, write_back)
            held.discard(evicted)
            changed.discard(evicted)
            actions.append(Action(i, "evict", evicted))
            over -= sizes[evicted]
        for name in access.chunks:
            if name not in held:
                held.add(name)
                actions.append(Action(i, "fetch", name))
        changed |= access.writes
        if i + 1 < len(accesses):
            room = min(budgets[i], budgets[i + 1]) - sum(sizes[c] for c in held)
            for name in accesses[i + 1].chunks:
                if name not in held and sizes[name] <= room:
                    held.add(name)
                    room -= sizes[name]
                    actions.append(Action(i + 1, "prefetch", name))
        for size, count in _by_size(held, sizes, lending).items():
            slots[size] = max(slots.get(size, 0), count)
    return Plan(tuple(actions), tuple(budgets), tuple(sorted(slots.items())))


def _by_size(names: Collection[str], sizes: dict[str, int], lending: Collection[str]) -> dict[int, int]:
    counts: dict[int, int] = {}
    for name in names:
        if name not in lending:
            counts[sizes[name]] = counts.get(sizes[name], 0) + 1
    return counts


def _check_inputs(accesses: Sequence[Access], sizes: dict[str, int], budgets: Sequence[int]) -> None:
    if len(budgets) != len(accesses):
        raise ValueError(f"{len(budgets)} budgets for {len(accesses)} accesses: give one budget per access")
    for i, access in enumerate(accesses):
        need = sum(sizes[c] for c in set(access.chunks))
        if need > budgets[i]:
            raise ValueError(f"access {i} needs {need} bytes of chunks at once ({', '.join(access.chunks)}) "
                             f"but its budget is {budgets[i]}")


Rule = Callable[[int, set[str], set[str]], str]  # (index, evictable, dirty among them) -> victim


def planned_rule(accesses: Sequence[Access], carried: Collection[str] = (), write_back: float = 2.0) -> Rule:
    """`build_plan`'s eviction rule, for `simulate`."""
    nexts = next_uses(accesses, carried)
    return lambda i, evictable, dirty: victim(i, evictable, nexts[i], dirty, write_back)


def simulate(accesses: Sequence[Access], sizes: dict[str, int], budgets: Sequence[int], rule: Rule,
             resident: Collection[str] = (), dirty: Collection[str] = (), free: Collection[str] = ()) -> dict:
    """Bytes moved by one step under an eviction `rule`, fetching on demand; no prefetch (it moves the
    same bytes earlier).

    `free` chunks hold no data yet (gradients after zero_grad): bringing them in copies nothing.
    The result also holds "end" and "end_dirty", the chunks resident (and changed) when the step ends.
    """
    held, changed, empty = set(resident), set(dirty) & set(resident), set(free)
    moved = {"h2d": 0, "d2h": 0, "fetches": 0}
    for i, access in enumerate(accesses):
        needed = set(access.chunks)
        while sum(sizes[c] for c in held | needed) > budgets[i]:
            evictable = held - needed
            evicted = rule(i, evictable, changed & evictable)
            held.discard(evicted)
            if evicted in changed:
                moved["d2h"] += sizes[evicted]
                changed.discard(evicted)
        for name in needed - held:
            held.add(name)
            if name not in empty:
                moved["h2d"] += sizes[name]
                moved["fetches"] += 1
        empty -= needed
        changed |= access.writes
    return moved | {"end": held, "end_dirty": changed}


def validate(plan: Plan, accesses: Sequence[Access], sizes: dict[str, int],
             resident: Collection[str] = ()) -> set[str]:
    """Replay `plan`: every access finds its chunks, no budget is exceeded. Returns what stays resident."""
    held = set(resident)
    for i, access in enumerate(accesses):
        for action in plan.at(i):
            if action.verb == "evict":
                if action.chunk not in held or action.chunk in access.chunks:
                    raise ValueError(f"{action}: not resident, or needed by the access it prepares")
                held.discard(action.chunk)
            elif action.chunk in held:
                raise ValueError(f"{action}: already resident")
            else:
                held.add(action.chunk)
        missing = set(access.chunks) - held
        if missing:
            raise ValueError(f"access {i} needs {sorted(missing)}, which the plan did not bring")
        if sum(sizes[c] for c in held) > plan.budgets[i]:
            raise ValueError(f"access {i}: {sum(sizes[c] for c in held)} bytes resident, budget {plan.budgets[i]}")
    return held
