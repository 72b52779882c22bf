"""The `cuda` executor: an interpreter of the bundle's launch program (runtime/program.py).

At load it picks the cubin and the program of the present GPU, allocates the arena the compiler planned
(runtime/cuda_arena.py), binds every launch and captures each decode bucket as a CUDA graph
(runtime/cuda_program.py). Nothing here knows the model: the layer sequence, grids, split counts and
buffer layout are the program's. Per step the host only writes the step values (tokens, positions, KV
slots, sampling parameters) into page-locked memory, sends them in one copy, replays one graph and reads
back the sampled token ids (and the logits of rows that ask for them). Prefill runs the program's
prefill phase per chunk with its per-step symbols (rows, start, slot), then a logits phase.

KV pages come from the caller (runtime/executor.py); the executor keeps a sequence slot per sequence
whose row in the device block table lists its pages. Slot 0 and page 0 are the padding the decode
graphs' unused rows use.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import numpy as np

from imp_runtime.bundle import Bundle, BundleError
from imp_runtime.cuda_arena import NP_DTYPES, DeviceArena
from imp_runtime.cuda_driver import CudaError, Module, PinnedBuffer, check, cu, gpu_available, htod, new_event
from imp_runtime.cuda_program import BoundPhase
from imp_runtime.executor import PrefillChunk, StepResult, StepRow
from imp_runtime.program import ProgramError, pack_step, unfuse
from imp_runtime.sampler import SamplingParams

__all__ = ["CudaExecutor", "gpu_available", "CudaError"]


def target_of(major: int, minor: int) -> str:
    return f"sm_{major}{minor}a"


@dataclass
class _Seq:
    slot: int
    pages: list[int] = field(default_factory=list)
    penalties: bool = False             # its slot's penalty state is on the device (init_penalties)


@dataclass
class _Launched:
    """A decode step queued on the stream whose results (in its result buffer) are not read yet."""
    number: int                         # the executor's count of launched decode steps
    rows: int
    want_logits: list[int]              # rows whose logits follow the sampled ids in the result buffer
    chunk_logits: list[bool] = field(default_factory=list)   # the step's chunks whose last-token logits follow
    chunk_sample: list[bool] = field(default_factory=list)   # ... and those whose first token the step sampled
    chunk_head: list[bool] = field(default_factory=list)     # chunks whose last row the step's head took
    ids_slot: int = -1                  # a decode step through mapped host memory: the id slot its sampler wrote


def norm_tail_rows(program) -> int:
    """The most rows a launch of the program norms in gemm_wq's tail (templates/gemm_wgmma_nvfp4.cu.j2 wq_norm_tail:
    the last blocks to finish, one a row, wait for the others, so the GPU must hold one more block than rows at
    once: a block an SM), or 0 where none does."""
    rows = [ph.tokens for ph in program.phases for x in ph.launches if any(b == "norm_count" for b, _ in x.writes)]
    return max(rows, default=0)


def barrier_launches(program) -> list:
    """The launches whose blocks wait for each other (gemv_ring_pair_*, --gemv-pair: a grid-wide barrier, so every
    block must be resident at once), one of each kernel, grid, block and shared memory."""
    return list({(x.kernel, x.grid, x.block, x.smem): x for ph in program.phases for x in ph.launches
                 if any(b == "pair_bar" for b, _ in x.reads)}.values())     # (the init phase's fill only writes it)


def barrier_grid(program) -> int:
    """The largest grid of those launches, or 0 where there are none."""
    return max((x.grid[0] for x in barrier_launches(program)), default=0)


def resident_program(program, holds) -> tuple[object, list[str]]:
    """The program a GPU runs that holds holds(launch) blocks of a launch at once: each grid-barrier launch whose grid
    it cannot hold (its barrier would never return) replaced by its fallback launches (runtime/program.py unfuse: the
    launches it fuses, the same bits); (that program, the kernels replaced). Raises ProgramError where such a launch
    has no fallback."""
    short = sorted({x.kernel for x in barrier_launches(program) if x.grid[0] > holds(x)})
    return (unfuse(program, set(short)) if short else program), short


def mps_enabled(dev) -> bool:
    """Whether contexts on this device are shared through MPS (False where the driver does not say)."""
    attr = getattr(cu.CUdevice_attribute, "CU_DEVICE_ATTRIBUTE_MPS_ENABLED", None)
    if attr is None:
        return False
    try:
        return bool(check(cu.cuDeviceGetAttribute(attr, dev)))
    except CudaError:
        return False


_log = logging.getLogger("imp.executor")


class CudaExecutor:
    name = "cuda"
    async_decode = True                 # decode_submit returns once the step is queued
    mixed_steps = True                  # the prefill phases carry decode rows (impc/launches.py prefill)

    def __init__(self, bundle: Bundle, use_graphs: bool = True, device: int = 0):
        t0 = time.perf_counter()
        if not gpu_available():
            raise CudaError("no NVIDIA GPU with a working driver")
        self.bundle, self.spec = bundle, bundle.spec
        self.dev = check(cu.cuDeviceGet(device))
        self.ctx = check(cu.cuDevicePrimaryCtxRetain(self.dev))
        check(cu.cuCtxSetCurrent(self.ctx))
        A = cu.CUdevice_attribute
        major = check(cu.cuDeviceGetAttribute(A.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, self.dev))
        minor = check(cu.cuDeviceGetAttribute(A.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, self.dev))
        self.gpu_name = check(cu.cuDeviceGetName(256, self.dev)).split(b"\0")[0].decode()
        self.target = target_of(major, minor)
        kern = bundle.manifest.get("kernels", {})
        present = kern.get("targets", [])
        if self.target not in present:
            raise BundleError(f"{bundle.path}: this GPU ({self.gpu_name}, {self.target}) has no kernels in the bundle; "
                              f"targets present: {', '.join(present) or 'none (a cpu-only bundle)'}; rebuild with "
                              f"`impc compile ... --target {self.target}` or run with --device cpu")
        self.program = p = bundle.program(self.target)
        sms = check(cu.cuDeviceGetAttribute(A.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, self.dev))
        need = norm_tail_rows(p)
        if need and sms <= need:
            raise BundleError(f"{bundle.path}: its decode GEMM norms a row a block once all its blocks have finished "
                              f"(the norm tail), at up to {need} rows: that needs more than {need} SMs, and this GPU "
                              f"({self.gpu_name}) has {sms}; rebuild with `impc compile ... --no-norm-tail`")
        c = p.constants
        self.page_size, self.num_pages, self.max_pages = c["page_size"], c["kv_pages"], c["max_pages"]
        self.max_batch, self.max_context, self.prefill_chunk = c["max_batch"], c["max_context"], c["prefill_chunk"]
        self.max_seqs, self.vocab = c["max_seqs"], c["vocab_size"]
        # several sequences' chunks in one prefill call (bundles compiled before it: one, and no tile table)
        self.max_segments = c.get("max_segments", 1)
        self.mixed_steps = "dec" in p.symbols       # prefill phases that carry decode rows
        self.samples_chunks = "srows" in p.symbols   # ... and sample prompt-ending chunks' first tokens with them
        self.penalty_values = "pen_counts" in p.buffers         # compiled with --gpu-penalties: the step applies
        self.penalties_on_device = self.penalty_values          # each row's (a caller may leave them to the host)
        self.fa_qtile, self.fa_tile_ints = c.get("fa_query_tile", 128), c.get("fa_tile_ints", 8)
        more = [bundle.file(kern["cutlass_cubins"][self.target]).read_bytes()] \
            if self.target in kern.get("cutlass_cubins", {}) else []      # --prefill-gemm cutlass
        self.module = Module(bundle.file(kern["cubins"][self.target]).read_bytes(), *more)
        for name, nbytes in p.kernel_smem.items():
            self.module.set_max_dynamic_smem(name, nbytes)

        # Under MPS other processes' kernels share the SMs (and a client may be held to a part of them), which the
        # occupancy API does not see: a grid barrier could wait for blocks that never become resident, so no launch
        # with one runs there.
        mps = mps_enabled(self.dev)

        def holds(x) -> int:             # blocks of launch x this GPU holds at once
            return 0 if mps else sms * check(cu.cuOccupancyMaxActiveBlocksPerMultiprocessor(
                self.module.func(x.kernel), x.block[0], x.smem))
        try:                             # a grid barrier's blocks all resident at once, or it never returns
            p, unfused = resident_program(p, holds)
            self.program = p
        except ProgramError:
            x = next(x for x in barrier_launches(p) if x.grid[0] > holds(x) and not x.fallback)
            raise BundleError(f"{bundle.path}: its decode step runs {x.kernel}, {x.grid[0]} blocks that wait for "
                              f"each other (--gemv-pair), and this GPU ({self.gpu_name}) holds {holds(x)} of them at "
                              f"once; rebuild with `impc compile ... --no-gemv-pair`") from None
        if unfused:
            why = ("is shared by MPS" if mps else f"({sms} SMs) cannot hold all the blocks of {', '.join(unfused)} "
                   f"at once")
            _log.warning("%s: this GPU (%s) %s (--gemv-pair): one-row decode runs the launches they fuse instead "
                         "(the same results, a little slower)", bundle.path, self.gpu_name, why)
        self.stream = check(cu.cuStreamCreate(cu.CUstream_flags.CU_STREAM_NON_BLOCKING.value))
        self.arena = DeviceArena(p, bundle, self.stream, self.gpu_name)
        self.phases = {(ph.phase, ph.tokens): BoundPhase(ph, self.module, self.arena, p.symbols) for ph in p.phases}
        self.phases[("init", 0)].run(self.stream)     # synthetic weights; Hopper: the fp16 copies prefill reads
        self.decode_buckets = p.buckets("decode")
        self.prefill_buckets = p.buckets("prefill")
        self.logits_buckets = p.buckets("logits")
        # host side of the step values (page-locked, sent in one copy per step) and of a step's results: two of each,
        # used in turn, so a step can be written and launched while the one before it runs and its results wait to
        # be read (an event per buffer marks its last copy done)
        self.step_off, step_bytes = p.step_region()
        self._step_bufs = [PinnedBuffer(step_bytes) for _ in range(2)]
        self._step_views = [{b.name: buf.view(b.offset - self.step_off, NP_DTYPES[b.dtype], b.shape[0])
                             for b in p.buffers.values() if b.kind == "step"} for buf in self._step_bufs]
        self._step_sent = [new_event(), new_event()]
        self._cur = 0
        self.step_host, self.step = self._step_bufs[0], self._step_views[0]
        self.logit_rows = logit_rows = p.buffers["logits"].shape[0]
        out_bytes = 4 * (logit_rows + self.max_segments) * (1 + self.vocab)      # ids, logits rows, chunks' logits
        self._out_bufs = [PinnedBuffer(out_bytes) for _ in range(2)]
        self._out_done = [new_event(), new_event()]
        # Decode steps without copies on the stream (programs with host_io, impc/arena_layout.py step_pack): a step's
        # values packed (word 0 its generation, the host's count of decode steps from 1), sent by a small copy on
        # another stream into one of two device staging slots while the step before runs, and spread over the step
        # arrays by the step's first kernel; its ids written by the sampler into one of two mapped host slots. The copy
        # before and the copy after a step's graph on the stream each cost a step 8-12 us (BENCHMARKS.md, twenty-ninth
        # session). A slot is written again once the step that last read it has run (_slot_done), its host side once
        # its copy is done (_copied).
        self._pack: list[tuple[int, int]] = []          # (byte offset in step_host, words a row) in the slots' order
        self._dec_slots: list[PinnedBuffer] = []
        self._stage: list[int] = []
        self._id_slots: list[PinnedBuffer] = []
        self._slot_done = [new_event(), new_event()]
        self._copied = [new_event(), new_event()]
        self._gen = 0
        self.copy_stream = None
        if "host_io" in p.buffers:
            self._pack = p.step_pack()
            # the generation's 16 bytes, the values, and room for the last reader's 16 bytes past them
            nbytes = 4 * (4 + self.max_batch * sum(w for _, w in self._pack) + 4)
            self._dec_slots = [PinnedBuffer(nbytes) for _ in range(2)]
            self._stage = [int(check(cu.cuMemAlloc(nbytes))) for _ in range(2)]
            for d in self._stage:
                check(cu.cuMemsetD8Async(d, 0, nbytes, self.stream))
            self._id_slots = [PinnedBuffer(4 * self.max_batch, mapped=True) for _ in range(2)]
            self.copy_stream = check(cu.cuStreamCreate(cu.CUstream_flags.CU_STREAM_NON_BLOCKING.value))
            io = np.zeros(p.buffers["host_io"].shape[0], np.uint64)
            io[0:4] = [*self._stage, *(b.device_ptr for b in self._id_slots)]
            htod(self.arena.ptr("host_io"), io, self.stream)
        # a step row may feed the token the previous step sampled for its sequence without the host reading it
        # (StepRow.token None): sid -> 1 + its row in that step's sampled ids
        self.feeds_sampled = "token_src" in self.step
        self._sampled_rows: dict[int, int] = {}
        self.block_tables = np.zeros((self.max_seqs, self.max_pages), np.int32)   # slot 0 -> page 0
        self._seqs: dict[int, _Seq] = {}
        self._next = 0
        self._launched = 0                # decode steps launched so far
        self._collected = 0               # ... and the last one collected (none in flight where equal)
        self.free_slots = list(range(self.max_seqs - 1, 0, -1))
        check(cu.cuStreamSynchronize(self.stream))
        self.use_graphs = use_graphs
        if use_graphs:
            for b in self.decode_buckets:
                self.phases[("decode", b)].capture(self.stream)
        check(cu.cuStreamSynchronize(self.stream))
        self.load_seconds = time.perf_counter() - t0

    # ------------------------------------------------------------------ sequences

    def new_sequence(self) -> int:
        if not self.free_slots:
            raise RuntimeError(f"all {self.max_seqs - 1} sequence slots are in use")
        sid, self._next = self._next, self._next + 1
        self._seqs[sid] = _Seq(slot=self.free_slots.pop())
        return sid

    def set_pages(self, sid: int, pages: list[int]) -> None:
        seq = self._seqs[sid]
        if len(pages) > self.max_pages:
            raise ValueError(f"{len(pages)} pages exceed the {self.max_pages} of a {self.max_context}-token context")
        if pages and not 0 < min(pages) <= max(pages) < self.num_pages:
            raise ValueError(f"pages must lie in 1..{self.num_pages - 1}")
        first = next((i for i, (a, b) in enumerate(zip(seq.pages, pages)) if a != b), min(len(seq.pages), len(pages)))
        seq.pages = list(pages)
        if first < len(pages):          # send only the entries that changed
            row = self.block_tables[seq.slot]
            row[first:len(pages)] = pages[first:]
            htod(self.arena.ptr("block_tables", (seq.slot * self.max_pages + first) * 4), row[first:len(pages)],
                 self.stream)

    def free(self, sid: int) -> None:
        seq = self._seqs.pop(sid, None)
        if seq is not None:
            self.free_slots.append(seq.slot)

    def init_penalties(self, sid: int, seen: list[int], counts: dict[int, int]) -> None:
        """The device's penalty state of sid, before its first step with penalties (and again after a preemption,
        in a new sequence): the prompt's tokens `seen` and the generated ones' counts (bundles compiled with
        --gpu-penalties)."""
        if not self.penalty_values:
            raise RuntimeError("this bundle samples penalties on the host (compile with --gpu-penalties)")
        seq = self._seqs[sid]
        bits = np.zeros(-(-self.vocab // 32), np.uint32)
        ids = np.unique(np.asarray(list(seen), np.int64))
        if ids.size and not 0 <= ids[0] <= ids[-1] < self.vocab:
            raise ValueError(f"penalty tokens must lie in 0..{self.vocab - 1}")
        np.bitwise_or.at(bits, ids >> 5, (np.uint32(1) << (ids & 31).astype(np.uint32)))
        row = np.zeros(self.vocab, np.int32)
        row[np.fromiter(counts, np.int64, len(counts))] = np.fromiter(counts.values(), np.int32, len(counts))
        htod(self.arena.ptr("pen_seen", seq.slot * bits.nbytes), bits.view(np.int32), self.stream)
        htod(self.arena.ptr("pen_counts", seq.slot * row.nbytes), row, self.stream)
        seq.penalties = True

    def _kv_slot(self, seq: _Seq, pos: int) -> int:
        i = pos // self.page_size
        if i >= len(seq.pages):
            raise ValueError(f"position {pos} has no KV page (the sequence holds {len(seq.pages)} pages)")
        return seq.pages[i] * self.page_size + pos % self.page_size

    # ------------------------------------------------------------------ steps

    def _send_step(self) -> None:
        check(cu.cuMemcpyHtoDAsync(self.arena.base + self.step_off, self.step_host.ptr, self.step_host.nbytes,
                                   self.stream))
        check(cu.cuEventRecord(self._step_sent[self._cur], self.stream))

    def _next_step_buffer(self) -> None:
        """Write the next step's values into the other step buffer, once its last copy to the device is done (the
        step before the previous one's: long done, unless the host runs two steps ahead)."""
        self._cur ^= 1
        check(cu.cuEventSynchronize(self._step_sent[self._cur]))
        self.step_host, self.step = self._step_bufs[self._cur], self._step_views[self._cur]

    def prefill(self, sid: int, tokens: list[int], start: int, all_logits: bool = False) -> np.ndarray:
        if not tokens:
            raise ValueError("no tokens to prefill")
        if start + len(tokens) > self.max_context:
            raise ValueError(f"sequence of {start + len(tokens)} tokens exceeds the context of {self.max_context}")
        rows = []
        for c0 in range(0, len(tokens), self.prefill_chunk):
            chunk = tokens[c0:c0 + self.prefill_chunk]
            t, pos0 = len(chunk), start + c0
            check(cu.cuStreamSynchronize(self.stream))        # the last copy from step_host is done
            phase, env = self._prefill_rows(0, [PrefillChunk(sid, chunk, pos0)])
            self._send_step()
            phase.run(self.stream, env)
            if all_logits:
                for r0 in range(0, t, self.logits_buckets[-1]):
                    rows.append(self._logits(r0, min(self.logits_buckets[-1], t - r0)))
        if all_logits:
            return np.concatenate(rows)
        return self._logits(t - 1, 1)[0]

    def _prefill_rows(self, n_dec: int, chunks: list[PrefillChunk],
                      head: list[bool] | None = None) -> tuple[BoundPhase, dict[str, int]]:
        """The chunks' step values (their rows follow n_dec decode rows) and the attention's tile table into
        step_host; the prefill phase that runs them (one chunk: the smallest that holds every row; several: the
        largest, whose attention walks the tile table) and its per-step symbols. `head`: the chunks whose last
        row the head and the sampler take, after the decode rows (their sampling values into step_host too)."""
        st, r, segments, heads = self.step, n_dec, [], 0
        head = head or [False] * len(chunks)
        for c, h in zip(chunks, head):
            seq, t = self._seqs[c.sid], len(c.tokens)
            st["tokens"][r:r + t] = c.tokens
            if self.feeds_sampled:
                st["token_src"][r:r + t] = 0
            pos = np.arange(c.start, c.start + t)
            st["positions"][r:r + t] = pos
            self._kv_slot(seq, c.start + t - 1)            # every page is there (a one-line error if not)
            st["kv_slots"][r:r + t] = np.asarray(seq.pages)[pos // self.page_size] * self.page_size + pos % self.page_size
            segments.append((r, t, c.start, seq.slot))
            r += t
            if h:                                          # the head's row n_dec + heads: its last token
                st["chunk_last"][heads] = r - 1
                self._sampling_values(n_dec + heads, seq, c.params if c.sample else None, c.start + t - 1)
                heads += 1
        qtiles = self.write_tiles(segments)
        bucket = self.prefill_buckets[-1] if len(chunks) > 1 else next(b for b in self.prefill_buckets if b >= r)
        first = chunks[0]
        return self.phases[("prefill", bucket)], {"rows": r, "dec": n_dec, "prows": len(first.tokens),
                                                  "start": first.start, "slot": self._seqs[first.sid].slot,
                                                  "qtiles": qtiles, "srows": n_dec + heads, "schunks": heads}

    def write_tiles(self, segments: list[tuple[int, int, int, int]], send: bool = False) -> int:
        """The largest prefill phase's attention tile table in step_host (sent when asked) from each chunk's
        (first row, rows, position of its first token, block-table slot); the number of tiles."""
        if "fa_tiles" not in self.step:                   # a bundle compiled before the tile table
            return 0
        if send:
            check(cu.cuStreamSynchronize(self.stream))    # the last copy from step_host is done
        tiles = []
        for r, t, start, slot in segments:
            for q0 in range(0, t, self.fa_qtile):        # (keys the tile reads, its entry)
                tiles.append((start + min(q0 + self.fa_qtile, t), (r, t, start, slot * self.max_pages, q0)))
        tiles.sort(key=lambda x: -x[0])                   # the longest first, as a one-chunk grid runs them
        table = self.step["fa_tiles"].reshape(-1, self.fa_tile_ints)
        for i, (_, entry) in enumerate(tiles):
            table[i, :5] = entry
        if send:
            self._send_step()
        return len(tiles)

    def _logits(self, row0: int, n: int) -> np.ndarray:
        bucket = next(b for b in self.logits_buckets if b >= n)
        self.phases[("logits", bucket)].run(self.stream, {"rows": n, "row0": row0})
        out = np.empty((n, self.vocab), np.float32)
        check(cu.cuMemcpyDtoHAsync(out.ctypes.data, self.arena.ptr("logits"), out.nbytes, self.stream))
        check(cu.cuStreamSynchronize(self.stream))
        return out

    def decode(self, rows: list[StepRow]) -> StepResult:
        return self.decode_collect(self.decode_submit(rows))

    def decode_submit(self, rows: list[StepRow], chunks: list[PrefillChunk] | None = None) -> _Launched:
        """Write the step values, send them, replay the bucket's graph and queue the copies of the sampled
        ids (and asked-for logits) into the step's result buffer; no wait for the GPU. With prefill chunks of other sequences (a
        mixed step; rows may then be empty): the decode rows ride in the chunks' prefill launches, run eagerly;
        a chunk that ends its prompt gets its first token sampled with them (`sample`) or its last token's logits
        (`want_logits`)."""
        chunks = chunks or []
        n, t = len(rows), sum(len(c.tokens) for c in chunks)
        if not (1 if not chunks else 0) <= n <= self.max_batch:
            raise ValueError(f"decode batch of {n} (1..{self.max_batch})")
        if chunks:
            if len(chunks) > self.max_segments or len({c.sid for c in chunks}) < len(chunks):
                raise ValueError(f"a step takes the chunks of 1..{self.max_segments} distinct sequences, not {len(chunks)}")
            if any(not c.tokens for c in chunks) or n + t > self.prefill_buckets[-1]:
                raise ValueError(f"a step of {n} decode rows takes chunks of 1..{self.prefill_buckets[-1] - n} tokens "
                                 f"in all, not {t}")
            for c in chunks:
                if c.start + len(c.tokens) > self.max_context:
                    raise ValueError(f"sequence of {c.start + len(c.tokens)} tokens exceeds the context of "
                                     f"{self.max_context}")
        head = self._head_rows(n, chunks)
        self._next_step_buffer()
        b = self._write_step_values(rows) if n else 0
        ids_slot = -1
        if not chunks and self._pack:         # through the staging slots: no copy on the stream
            ids_slot = q = self.stage_step(b)
            self.phases[("decode", b)].run(self.stream, None if self.use_graphs else {})
            check(cu.cuEventRecord(self._slot_done[q], self.stream))
        elif not chunks:
            self._send_step()
            self.phases[("decode", b)].run(self.stream, None if self.use_graphs else {})
        else:       # the chunks' rows follow the decode rows
            phase, env = self._prefill_rows(n, chunks, head)
            self._send_step()
            phase.run(self.stream, env)
        # the sampled ids of the decode rows and of the chunks' head rows after them (the buffer's first words), then
        # the logits rows asked for: decode rows', then chunks' (head row n + k for the k-th chunk with a head row)
        ids = n + sum(head)
        out = self._out_bufs[(self._launched + 1) % 2]
        if ids and ids_slot < 0:
            check(cu.cuMemcpyDtoHAsync(out.ptr, self.arena.ptr("sampled"), 4 * ids, self.stream))
        want = [i for i, r in enumerate(rows) if r.want_logits]
        want += [n + k for k, c in enumerate(c for c, h in zip(chunks, head) if h) if c.want_logits]
        row_bytes = 4 * self.vocab
        for k, i in enumerate(want):
            check(cu.cuMemcpyDtoHAsync(out.ptr + 4 * ids + k * row_bytes, self.arena.ptr("logits", i * row_bytes),
                                       row_bytes, self.stream))
        at, last = 4 * ids + len(want) * row_bytes, n
        for c, h in zip(chunks, head):      # chunks the head did not take: a logits call each, after the copies
            last += len(c.tokens)           # above (each rewrites logits row 0)
            if c.want_logits and not h:
                self.phases[("logits", self.logits_buckets[0])].run(self.stream, {"rows": 1, "row0": last - 1})
                check(cu.cuMemcpyDtoHAsync(out.ptr + at, self.arena.ptr("logits"), row_bytes, self.stream))
                at += row_bytes
        self._launched += 1
        check(cu.cuEventRecord(self._out_done[self._launched % 2], self.stream))
        # where each sequence's sampled token sits for the next step to feed (1 + its row in sampled)
        self._sampled_rows = {r.sid: i + 1 for i, r in enumerate(rows)}
        k = n
        for c, h in zip(chunks, head):
            if h:
                k += 1
                if c.sample:
                    self._sampled_rows[c.sid] = k
        return _Launched(self._launched, n, want, [c.want_logits for c in chunks], [c.sample for c in chunks], head,
                         ids_slot)

    def stage_step(self, b: int) -> int:
        """The step values in step_host (b rows) packed into the next generation's staging slot, its copy queued on
        the copy stream and the stream made to wait for it (a decode phase's first kernel reads the slot); the slot.
        Where no step is in flight (each step submitted after the last one's ids were read: host sampling, structured
        output) the copy goes on the stream itself: nothing runs beside it to hide it, and the event hop between the
        streams would be on the step's path (with it on every step, such steps measured 1-4% slower; BENCHMARKS.md,
        twenty-ninth session).
        A decode phase's sampler makes the generation the device's last (host_io HIO_GEN); a caller that runs the
        first kernel without it (a kernel test) writes that word itself, or the next step's values go unread."""
        self._gen += 1
        q = self._gen & 1
        check(cu.cuEventSynchronize(self._copied[q]))         # the host slot's last copy is done
        slot = self._dec_slots[q]
        at = pack_step(self.step_host.array, self._pack, b, self._gen, slot.array)
        beside = self._collected < self._launched            # a step in flight: copy beside it
        stream = self.copy_stream if beside else self.stream
        if beside:
            check(cu.cuStreamWaitEvent(self.copy_stream, self._slot_done[q], 0))   # the step that read it last has run
        check(cu.cuMemcpyHtoDAsync(self._stage[q], slot.ptr, at + 16, stream))
        check(cu.cuEventRecord(self._copied[q], stream))
        if beside:
            check(cu.cuStreamWaitEvent(self.stream, self._copied[q], 0))
        return q

    def _head_rows(self, n: int, chunks: list[PrefillChunk]) -> list[bool]:
        """Which chunks' last rows the step's head takes after its n decode rows: every chunk sampled in the step,
        and those asking for logits if the logits buffer has rows for all of them (else each gets a logits call
        after the step, which reads its row of x: so no row may be gathered over it then, and a step that samples
        chunks must have rows for every chunk asking for logits)."""
        sampled = sum(c.sample for c in chunks)
        if sampled and not self.samples_chunks:
            raise ValueError("this bundle's prefill does not sample (compiled before it did): ask for logits")
        spare = self.logit_rows - n - sampled
        if spare < 0:
            raise ValueError(f"a step samples at most {self.logit_rows} rows, not {n} decode rows and {sampled} "
                             f"prompt-ending chunks")
        wanted = sum(c.want_logits and not c.sample for c in chunks)
        take = self.samples_chunks and wanted <= spare
        if sampled and wanted and not take:
            raise ValueError(f"a step of {n} decode rows has rows for {spare} of its {wanted} chunks asking for "
                             f"logits beside the {sampled} it samples")
        return [c.sample or (take and c.want_logits) for c in chunks]

    def _write_step_values(self, rows: list[StepRow]) -> int:
        """The decode step's values into step_host, padding rows up to the graph bucket; the bucket."""
        n = len(rows)
        b = next(x for x in self.decode_buckets if x >= n)
        st = self.step
        feeds = self.feeds_sampled
        for i, r in enumerate(rows):
            seq = self._seqs[r.sid]
            if r.token is None:       # the token the previous step sampled for this sequence, on the device
                src = self._sampled_rows.get(r.sid)
                if src is None or not feeds:
                    raise ValueError(f"sequence {r.sid} has no token sampled by the previous step to feed")
                st["tokens"][i], st["token_src"][i] = 0, src
            else:
                st["tokens"][i] = r.token
                if feeds:
                    st["token_src"][i] = 0
            st["positions"][i] = r.position
            st["kv_slots"][i] = self._kv_slot(seq, r.position)
            st["seq_len"][i] = r.position + 1
            self._sampling_values(i, seq, r.params, r.position)
        pads = [("tokens", 0), ("positions", 0), ("kv_slots", 0), ("seq_slot", 0), ("seq_len", 1), ("temperature", 0.0)]
        if feeds:
            pads.append(("token_src", 0))
        if self.penalty_values:
            pads += [("repetition_penalty", 1.0), ("presence_penalty", 0.0), ("frequency_penalty", 0.0)]
        for name, pad in pads:      # padding rows: the padding slot and page, greedy, no penalties
            st[name][n:b] = pad
        return b

    def _sampling_values(self, i: int, seq: _Seq, p: SamplingParams | None, position: int) -> None:
        """Row i's sampling values in step_host: its sequence's slot, its parameters (None: greedy) and the position
        of the token it feeds (the seeded draw's step)."""
        st = self.step
        st["seq_slot"][i] = seq.slot
        st["temperature"][i] = p.temperature if p else 0.0
        st["top_k"][i] = p.top_k if p else 0
        st["top_p"][i] = p.top_p if p else 1.0
        st["min_p"][i] = p.min_p if p else 0.0
        st["seed"][i] = (p.seed if p and p.seed is not None else 0) & 0xFFFFFFFFFFFFFFFF
        st["step"][i] = position
        if self.penalty_values:       # every row's, whoever applies them (a host-sampled row: params None, none)
            rep, pres, freq = (p.repetition_penalty, p.presence_penalty, p.frequency_penalty) if p else (1.0, 0.0, 0.0)
            if (rep != 1.0 or pres != 0.0 or freq != 0.0) and not seq.penalties:
                raise ValueError(f"a sequence (slot {seq.slot}) samples with penalties before init_penalties")
            st["repetition_penalty"][i], st["presence_penalty"][i], st["frequency_penalty"][i] = rep, pres, freq

    def decode_collect(self, handle: _Launched) -> StepResult:
        """Wait for the step (the driver releases the GIL while it blocks) and read its result buffer."""
        if handle.number < self._launched - 1:      # its results buffer holds a later step's now
            raise RuntimeError(f"decode step {handle.number} was collected after step {self._launched} was launched")
        check(cu.cuEventSynchronize(self._out_done[handle.number % 2]))
        self._collected = max(self._collected, handle.number)
        out = self._out_bufs[handle.number % 2]
        n, row_bytes = handle.rows, 4 * self.vocab
        heads = handle.chunk_head
        ids = n + sum(heads)
        ids_buf = self._id_slots[handle.ids_slot] if handle.ids_slot >= 0 else out
        sampled = ids_buf.view(0, np.int32, ids).tolist() if ids else []
        rows = {i: out.view(4 * ids + k * row_bytes, np.float32, self.vocab).copy()
                for k, i in enumerate(handle.want_logits)}
        logits = {i: v for i, v in rows.items() if i < n}
        tokens, chunks, k, at = [], [], n, 4 * ids + len(handle.want_logits) * row_bytes
        for j, (wanted, sample) in enumerate(zip(handle.chunk_logits, handle.chunk_sample)):
            if heads[j]:
                chunks.append(rows[k] if wanted else None)
                tokens.append(sampled[k] if sample else None)
                k += 1
            else:
                chunks.append(out.view(at, np.float32, self.vocab).copy() if wanted else None)
                tokens.append(None)
                at += row_bytes if wanted else 0
        return StepResult(sampled[:n], logits, chunks, tokens)

    # ------------------------------------------------------------------ the rest

    def run_launch(self, phase: str, tokens: int, index: int, env: dict[str, int] | None = None) -> None:
        """One launch of the program on its own (kernel tests)."""
        bound = self.phases[(phase, tokens)].launches[index]
        e = dict(self.program.symbols, rows=tokens, dec=0)
        e.update(env or {})
        e["prows"] = (env or {}).get("prows", e["rows"] - e["dec"])    # a chunk without decode rows unless env says
        e["schunks"] = (env or {}).get("schunks", 0)                    # ... and no chunk's first token sampled
        e["srows"] = (env or {}).get("srows", e["dec"] + e["schunks"])
        bound.run(self.stream, e)

    def synchronize(self) -> None:
        check(cu.cuStreamSynchronize(self.stream))

    def memory(self) -> dict:
        free, total = check(cu.cuMemGetInfo())
        a = self.arena
        return {"weights_bytes": a.bytes_of("weight"), "kv_bytes": a.bytes_of("kv"), "kv_pages": self.num_pages,
                "scratch_bytes": a.nbytes - a.bytes_of("weight") - a.bytes_of("kv"), "arena_bytes": a.nbytes,
                "device_used_bytes": int(total) - int(free), "device_total_bytes": int(total)}

    def close(self) -> None:
        """Give every device allocation back (the executor is unusable afterwards)."""
        for ph in getattr(self, "phases", {}).values():
            ph.release()
        for buf in (getattr(self, "_step_bufs", []) + getattr(self, "_out_bufs", []) + getattr(self, "_dec_slots", [])
                    + getattr(self, "_id_slots", [])):
            buf.free()
        for d in getattr(self, "_stage", []):
            cu.cuMemFree(d)
        if getattr(self, "copy_stream", None) is not None:
            cu.cuStreamDestroy(self.copy_stream)
        for ev in (getattr(self, "_step_sent", []) + getattr(self, "_out_done", []) + getattr(self, "_slot_done", [])
                   + getattr(self, "_copied", [])):
            cu.cuEventDestroy(ev)
        if getattr(self, "arena", None) is not None:
            self.arena.free()
