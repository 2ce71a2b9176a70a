"""Placement plans: which chunks to fetch, prefetch and evict at each access of a recorded step.

Pure functions over names and sizes, tested without a device. `build_plan` applies Belady's rule
(evict the resident chunk whose next use is furthest away) under a budget that changes from one
access to the next (what the non-model data leaves free), and prefetches the next access's chunks
into room that is already free. `simulate` replays any eviction rule on the same sequence and
counts the bytes a step moves, write-backs of chunks changed on the device included.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

INFINITY = 1 << 62


@dataclasses.dataclass(frozen=True)
class Access:
    """Chunks needed on the device together at one moment; `writes` are changed there."""

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

    def at(self, index: int) -> list[Action]:
        return [a for a in self.actions if a.at == index]

    def __str__(self) -> str:
        return "\n".join(map(str, self.actions))


def next_uses(accesses: Sequence[Access]) -> list[dict[str, int]]:
    """For each access i, the index of the next access (> i) of every chunk used later."""
    later: dict[str, int] = {}
    table: list[dict[str, int]] = [{}] * len(accesses)
    for i in range(len(accesses) - 1, -1, -1):
        table[i] = dict(later)
        for name in accesses[i].chunks:
            later[name] = i
    return table


def build_plan(accesses: Sequence[Access], sizes: dict[str, int], budgets: Sequence[int],
               resident: set[str] = frozenset()) -> Plan:  # type: ignore[assignment]
    """Belady placement of `accesses` with `budgets[i]` bytes for chunks at access i."""
    _check_inputs(accesses, sizes, budgets)
    nxt = next_uses(accesses)
    held = set(resident)
    actions: list[Action] = []
    for i, access in enumerate(accesses):
        needed = set(access.chunks)
        over = sum(sizes[c] for c in held | needed) - budgets[i]
        for victim in sorted(held - needed, key=lambda c: (-nxt[i].get(c, INFINITY), c)):
            if over <= 0:
                break
            held.discard(victim)
            actions.append(Action(i, "evict", victim))
            over -= sizes[victim]
        for name in access.chunks:
            if name not in held:
                held.add(name)
                actions.append(Action(i, "fetch", name))
        if i + 1 < len(accesses):
            room = min(budgets[i], budgets[i + 1]) - sum(sizes[c] for c in held)
            for name in accesses[i + 1].chunks:
                if name not in held and sizes[name] <= room:
                    held.add(name)
                    room -= sizes[name]
                    actions.append(Action(i + 1, "prefetch", name))
    return Plan(tuple(actions), tuple(budgets))


def _check_inputs(accesses: Sequence[Access], sizes: dict[str, int], budgets: Sequence[int]) -> None:
    if len(budgets) != len(accesses):
        raise ValueError(f"{len(budgets)} budgets for {len(accesses)} accesses: give one budget per access")
    for i, access in enumerate(accesses):
        need = sum(sizes[c] for c in set(access.chunks))
        if need > budgets[i]:
            raise ValueError(f"access {i} needs {need} bytes of chunks at once ({', '.join(access.chunks)}) "
                             f"but its budget is {budgets[i]}")


Rule = Callable[[int, set[str], set[str]], str]  # (index, evictable, needed) -> victim


def simulate(accesses: Sequence[Access], sizes: dict[str, int], budgets: Sequence[int], rule: Rule,
             resident: set[str] = frozenset(), dirty: set[str] = frozenset(),  # type: ignore[assignment]
             free: set[str] = frozenset()) -> dict:  # type: ignore[assignment]
    """Bytes moved by one step under an eviction `rule`, fetching on demand; no prefetch.

    `free` chunks hold no data yet (gradients after zero_grad): bringing them in copies nothing.
    The result also holds "end", the chunks resident when the step ends.
    """
    held, changed, empty = set(resident), set(dirty), set(free)
    moved = {"h2d": 0, "d2h": 0, "fetches": 0}
    for i, access in enumerate(accesses):
        needed = set(access.chunks)
        while sum(sizes[c] for c in held | needed) > budgets[i]:
            victim = rule(i, held - needed, needed)
            held.discard(victim)
            if victim in changed:
                moved["d2h"] += sizes[victim]
                changed.discard(victim)
        for name in needed - held:
            held.add(name)
            if name not in empty:
                moved["h2d"] += sizes[name]
                moved["fetches"] += 1
        empty -= needed
        changed |= access.writes
    return moved | {"end": held}


def validate(plan: Plan, accesses: Sequence[Access], sizes: dict[str, int],
             resident: set[str] = frozenset()) -> set[str]:  # type: ignore[assignment]
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
