"""How a torch-memory-saver region's live allocations are found in PyTorch's allocator snapshot (no GPU needed:
the snapshot is plain data; its shape is torch.cuda.memory._snapshot()'s)."""
from __future__ import annotations

from timeslice.torch_regions import live_spans

MiB = 1 << 20


def seg(addr, pool, blocks, device=0):
    out, at = [], addr
    for size, state in blocks:
        out.append({"address": at, "size": size, "state": state})
        at += size
    return {"device": device, "address": addr, "total_size": at - addr, "segment_pool_id": pool, "blocks": out}


def test_live_blocks_of_the_regions_pool_merged_within_a_segment_never_across():
    pool = (1, 7)
    segments = [
        seg(0x10000000, pool, [(2 * MiB, "active_allocated"), (2 * MiB, "active_allocated"), (4 * MiB, "inactive"),
                               (2 * MiB, "active_awaiting_free")]),
        seg(0x10000000 + 10 * MiB, pool, [(8 * MiB, "active_allocated")]),   # adjacent, but another allocation
        seg(0x20000000, (0, 0), [(8 * MiB, "active_allocated")]),              # the default pool: not the region's
        seg(0x30000000, pool, [(8 * MiB, "active_allocated")], device=1),      # the region's pool on another GPU
        seg(0x40000000, pool, [(2 * MiB, "inactive")]),                        # cached, nothing live
    ]
    assert live_spans(segments, [1, 7], 0) == [(0x10000000, 4 * MiB), (0x10000000 + 8 * MiB, 2 * MiB),
                                               (0x10000000 + 10 * MiB, 8 * MiB)]


def test_the_checksum_sees_a_changed_word_and_words_moved_within_a_row_across_rows_and_across_spans():
    torch = __import__("pytest").importorskip("torch", reason="needs the test extra (torch)")
    from timeslice.torch_regions import MAX_COLS, ROW_WORDS, Sums

    def digest(*tensors):
        s = Sums(torch)
        for t in tensors:
            s.add(t.view(torch.uint8))
        return s.digest([t.numel() * t.element_size() for t in tensors])

    g = torch.Generator().manual_seed(3)
    a = torch.randint(-2**62, 2**62, (2 * MAX_COLS,), generator=g, dtype=torch.int64)   # two rows
    b = torch.randint(-2**62, 2**62, (1024,), generator=g, dtype=torch.int64)
    odd = torch.arange(13, dtype=torch.uint8)                                            # not 8-aligned in size
    base = digest(a, b, odd)
    assert digest(a.clone(), b.clone(), odd.clone()) == base                             # a function of the bytes

    def changed(fn):
        x, y, z = a.clone(), b.clone(), odd.clone()
        fn(x, y, z)
        return digest(x, y, z)

    def swap(t, i, j, u=None):
        u = t if u is None else u
        ti, uj = t[i].clone(), u[j].clone()
        t[i], u[j] = uj, ti
    assert changed(lambda x, y, z: x.__setitem__(5, x[5] + 1)) != base                  # one word
    assert changed(lambda x, y, z: swap(x, 1, 7)) != base                                # within a row
    assert changed(lambda x, y, z: swap(x, 3, MAX_COLS + 3)) != base                     # same column, two rows
    assert changed(lambda x, y, z: swap(x, 0, 0, y)) != base                             # across spans
    assert changed(lambda x, y, z: z.__setitem__(2, 99)) != base                         # the unaligned span
    assert digest(b, a, odd) != base                                                     # the spans' order
    assert changed(lambda x, y, z: swap(x, 3, ROW_WORDS + 3)) != base                   # two 4 KiB rows


def test_the_clean_checksum_sees_changes_and_moves_between_4k_rows_and_says_what_it_cannot_see():
    torch = __import__("pytest").importorskip("torch", reason="needs the test extra (torch)")
    from timeslice.torch_regions import ROW_WORDS, Sums

    def both(*tensors, cols=True):
        s = Sums(torch, cols=cols)
        for t in tensors:
            s.add(t.view(torch.uint8))
        return s.digests([t.numel() * t.element_size() for t in tensors])

    g = torch.Generator().manual_seed(5)
    a = torch.randint(-2**62, 2**62, (8 * ROW_WORDS,), generator=g, dtype=torch.int64)
    b = torch.randint(-2**62, 2**62, (ROW_WORDS + 64,), generator=g, dtype=torch.int64)   # a short last row
    full, clean = both(a, b)
    assert both(a, b, cols=False) == (clean, clean)                    # one pass gives the same clean digest
    assert full != clean

    def after(fn):
        x, y = a.clone(), b.clone()
        fn(x, y)
        return both(x, y)

    def swap(x, i, j):
        xi = x[i].clone()
        x[i] = x[j]
        x[j] = xi
    assert after(lambda x, y: x.__setitem__(7, x[7] ^ 1))[1] != clean               # one word
    assert after(lambda x, y: y.__setitem__(ROW_WORDS + 1, 0))[1] != clean          # in the short last row
    assert after(lambda x, y: swap(x, 2, 2 * ROW_WORDS + 9))[1] != clean            # across 4 KiB rows
    assert both(b, a)[1] != clean                                                   # the spans' order
    moved = after(lambda x, y: swap(x, 2, 9))                                       # within one 4 KiB row:
    assert moved[1] == clean and moved[0] != full                                   # only the full one sees it
