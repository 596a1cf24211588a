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
