"""Preemption by swapping, on top of admission: a group of sequences moves to a host pool and back.

`swap_out(*seqs)` copies the sequences' blocks to a host `BlockAllocator` (blocks they share stay shared
there) and frees them on the device; `swap_in(*seqs)` brings them back when `can_swap_in` says NOW. Each
returns the (source block, destination block) copies for the engine to perform. A swapped-out sequence
is not in `tables` (nor in `lengths`) until it is back. (The other way to preempt, recomputation, needs no
support here: free the sequence, and later `add` its prompt and generated tokens again in one prefill.)
"""
import collections

from .admission import WatermarkTables, admission_status
from .allocator import BlockAllocator, OutOfBlocks

__all__ = ["SwappingTables", "copy_blocks"]


def copy_blocks(owners, pool):
    """A block of `pool` for each block in `owners` ({block: owners}), with as many owners: {old: new}."""
    mapping = {}
    for block, count in owners.items():
        mapping[block] = pool.allocate()
        for _ in range(count - 1):
            pool.share(mapping[block])
    return mapping


class SwappingTables(WatermarkTables):
    """Admission-controlled block tables that can swap sequences out to a host pool and back."""

    def __init__(self, allocator, *, host=None, **options):
        super().__init__(allocator, **options)
        if host is not None and (not isinstance(host, BlockAllocator) or host.block_size != allocator.block_size):
            raise ValueError(f"host must be a BlockAllocator with block_size {allocator.block_size}, got {host!r}")
        self.host = host
        self.swapped = {}                          # seq -> (host block table, length) while swapped out

    def swap_out(self, *seqs):
        """Moves `seqs` (one group: blocks they share stay shared) to the host pool; returns the
        (device block, host block) copies to perform. All or nothing on OutOfBlocks."""
        if self.host is None:
            raise ValueError("swap_out needs a host pool: SwappingTables(allocator, host=BlockAllocator(...))")
        owners = self.group_owners(seqs, self.tables, "on the device")
        if len(owners) > self.host.num_free:
            raise OutOfBlocks(f"host pool: {seqs!r} need {len(owners)} blocks, {self.host.num_free} are free")
        to_host = copy_blocks(owners, self.host)
        for seq in seqs:
            table = self.tables.pop(seq)
            self.swapped[seq] = ([to_host[block] for block in table], self.lengths.pop(seq))
            for block in reversed(table):
                self.allocator.free(block)
        return list(to_host.items())

    def can_swap_in(self, *seqs):
        """NOW, LATER or NEVER for bringing `seqs` back, keeping the watermark free."""
        owners = self.group_owners(seqs, self.swapped_tables(), "swapped out")
        return admission_status(self.allocator.num_free, self.allocator.num_blocks, self.swap_in_cost(seqs, owners),
                                self.watermark_blocks, all_blocks=len(owners))

    def swap_in(self, *seqs):
        """Brings swapped-out `seqs` back to the device; returns the (host block, device block) copies.
        All or nothing on OutOfBlocks."""
        owners = self.group_owners(seqs, self.swapped_tables(), "swapped out")
        need = self.swap_in_cost(seqs, owners)
        if need > self.allocator.num_free:
            raise OutOfBlocks(f"{seqs!r} need {need} blocks, {self.allocator.num_free} are free")
        to_device, copies = self.device_blocks(seqs, owners)
        for seq in seqs:
            table, length = self.swapped.pop(seq)
            self.tables[seq], self.lengths[seq] = [to_device[block] for block in table], length
            for block in reversed(table):
                self.host.free(block)
        return copies

    # -- what the prefix cache changes (serving.py): some blocks may still be on the device ---------------------
    def swap_in_cost(self, seqs, owners):
        """Device blocks that swapping `seqs` in takes from the pool: one per distinct host block here."""
        return len(owners)

    def device_blocks(self, seqs, owners):
        """({host block: device block}, [(host block, device block) copies]) for `owners`: each one copied."""
        to_device = copy_blocks(owners, self.allocator)
        return to_device, list(to_device.items())

    def free(self, seq):
        """Release every block of `seq`, on the device or swapped out to the host."""
        if seq in self.swapped:
            for block in reversed(self.swapped.pop(seq)[0]):
                self.host.free(block)
        else:
            super().free(seq)

    def swapped_tables(self):
        """{seq: host block table} of the swapped-out sequences."""
        return {seq: table for seq, (table, _) in self.swapped.items()}

    @staticmethod
    def group_owners(seqs, tables, where):
        """{block: how many of `seqs` own it} over `tables`; `where` names the tables in errors."""
        if not seqs:
            raise ValueError("name at least one sequence")
        if len(set(seqs)) != len(seqs):
            raise ValueError(f"seqs must be distinct, got {seqs!r}")
        for seq in seqs:
            if seq not in tables:
                raise KeyError(f"seq {seq!r} is not {where}")
        return collections.Counter(block for seq in seqs for block in tables[seq])

    def table(self, seq):
        if seq in self.swapped:
            raise KeyError(f"seq {seq!r} is swapped out (swap_in first)")
        return super().table(seq)

    def check_new(self, seq):
        if seq in self.swapped:
            raise ValueError(f"seq {seq!r} already exists")
        super().check_new(seq)
