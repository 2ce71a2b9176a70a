"""Packing parameters into chunks and searching the chunk size, on plain (name, numel) lists."""

from __future__ import annotations

import pytest

from chunkmem.chunks.layout import ALIGN, CHUNK_BANDS, chunk_size_bands, pack, search_chunk_size


def test_pack_fills_chunks_in_order_and_opens_a_new_one_when_full():
    layout = pack([("a", 6), ("b", 3), ("c", 2), ("d", 10)], chunk_size=10)
    assert [(s.name, s.chunk, s.offset) for s in layout.slots] == [("a", 0, 0), ("b", 0, 6), ("c", 1, 0), ("d", 2, 0)]
    assert layout.num_chunks == 3
    assert layout.wasted == 30 - 21


def test_pack_rounds_chunk_count_to_the_world_size():
    assert pack([("a", 6), ("b", 6), ("c", 6)], chunk_size=10, multiple_of=2).num_chunks == 4


def test_chunk_smaller_than_a_parameter_names_it():
    with pytest.raises(ValueError, match=r"'big' has 11 elements, more than chunk_size=10"):
        pack([("a", 3), ("big", 11)], chunk_size=10)


def test_search_picks_the_least_waste_at_least_the_largest_parameter():
    params = [("w1", 1000), ("b1", 64), ("w2", 1000), ("b2", 64)]
    size = search_chunk_size(params)
    assert size >= 1000 and size % ALIGN == 0
    # 1088 holds one weight and its bias: 2 chunks, 48 elements wasted; 1024 would waste 1024 - 64 twice.
    assert size == 1088
    assert pack(params, size).wasted == 2 * 1088 - 2128


def test_search_never_goes_below_the_largest_parameter():
    params = [("emb", 5000), ("w", 100)]
    assert search_chunk_size(params) >= 5000


def test_search_counts_the_chunks_that_round_up_to_the_world_size():
    # One 2240-element chunk holds everything, but 3 ranks need 3 chunks: two of them empty. Two chunks
    # of 1536 (plus one empty) waste about half as much.
    params = [("p0", 500), ("p1", 128), ("p2", 64), ("p3", 1500)]
    assert search_chunk_size(params) == 2240
    assert search_chunk_size(params, multiple_of=3) == 1536
    assert pack(params, 1536, multiple_of=3).wasted < pack(params, 2240, multiple_of=3).wasted / 1.5


def test_bands_take_a_size_in_each_span_of_the_largest_parameter_none_within_5_percent_of_another():
    params = [(f"p{i}", 640 + 64 * (i % 5)) for i in range(40)]
    largest = max(n for _, n in params)
    sizes = chunk_size_bands(params)
    assert sizes == sorted(sizes) and len(sizes) >= 3 and sizes[0] >= largest
    assert all(any(largest * low - ALIGN <= s <= largest * high + ALIGN for low, high in CHUNK_BANDS) for s in sizes)
    assert all(b > a * 1.05 for a, b in zip(sizes, sizes[1:]))
    assert pack(params, sizes[0]).wasted <= pack(params, largest).wasted, "the least wasteful of its band"
    default = search_chunk_size(params)
    assert all(abs(s - default) > default * 0.05 for s in chunk_size_bands(params, besides=default))
