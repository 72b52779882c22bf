"""The interface every executor implements: `cpu` (executor_cpu.py, the numpy reference) and `cuda`
(executor_cuda.py, the interpreter of the bundle's launch program).

KV pages belong to the caller (the block manager, runtime/kv_blocks.py): an executor stores a sequence's
keys and values in the pages it is given and never picks a page itself, so a prefix cache can hand one
page to several sequences. Page 0 is the padding page (padding rows of a decode batch write there);
pages 1 .. num_pages - 1 are the usable pool.

A decode step samples on the device with each row's parameters (temperature, top-k, top-p, min-p,
seed; and repetition / presence / frequency penalties where `penalties_on_device`, from a per-sequence state
`init_penalties` writes); a row's logits come back to the host only when the row asks for them (logprobs,
penalties otherwise, or a token-mask constraint, which the engine then applies on the host).

A decode step is launched and read in two calls, so the host can work while the device computes:
`decode_submit` writes the step's values and launches it, `decode_collect` waits for it and reads the
sampled tokens. Between them the caller may do host work and call `set_pages`, `new_sequence`, `free` and
`prefill` (device work queued behind the step, in order). It may submit the next step before collecting one
(two in flight at most; collect in order; a step not collected by the time the one after the next is submitted
is dropped): on executors with `feeds_sampled` the next step's rows then feed the tokens the previous step
samples without the host reading them (StepRow.token None). `decode` is both at once.

A decode step may carry prefill chunks of other sequences (`decode_submit(rows, chunks)`, executors with
`mixed_steps`; rows may then be empty): a mixed step. On the GPU the decode rows and the chunks of up to
`max_segments` sequences then share one pass of prefill launches, so each layer weight is read once for all
(a decode step of 64 rows alone costs about as much as 128 rows of prefill, and four 512-token prompts in one
2048-row call prefill 1.4x as fast as one by one); a chunk that ends its prompt gets its first token sampled
in the step with the decode rows (`sample`, executors with `samples_chunks`) or its last-token logits back
(`want_logits`, for a request the host samples).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from imp_runtime.sampler import SamplingParams


@dataclass
class StepRow:
    """One sequence's row in a decode step."""
    sid: int
    token: int | None                   # the token this step feeds (its KV lands at `position`); None: the one the
                                        # previous step sampled for sid, fed on the device (`feeds_sampled`)
    position: int                       # = the sequence's length before the step
    params: SamplingParams | None = None   # None: greedy
    want_logits: bool = False           # copy this row's logits to the host


@dataclass
class PrefillChunk:
    """A prefill chunk riding in a decode step: `tokens` of sequence sid at positions start .."""
    sid: int
    tokens: list[int]
    start: int
    want_logits: bool = False           # return the last token's logits (the chunk ends the prompt)
    sample: bool = False                # sample the next token on the device (the chunk ends the prompt;
                                        # executors with `samples_chunks`)
    params: SamplingParams | None = None    # how, when `sample` (None: greedy)


@dataclass
class StepResult:
    tokens: list[int]                   # one sampled token per row, in row order
    logits: dict[int, np.ndarray] = field(default_factory=dict)   # row index -> float32 [vocab], rows that asked
    chunk_logits: list[np.ndarray | None] = field(default_factory=list)   # a mixed step's chunks' last-token
                                                                            # logits [vocab], where asked
    chunk_tokens: list[int | None] = field(default_factory=list)   # each chunk's sampled next token, where asked


class Executor(Protocol):
    name: str
    page_size: int                      # tokens per KV page
    num_pages: int                      # pages in the pool, page 0 (padding) included
    max_batch: int                      # most rows in one decode step
    max_context: int                    # most positions in one sequence
    prefill_chunk: int                  # most tokens one prefill call takes (callers chunk longer prompts)
    async_decode: bool                  # decode_submit returns before the step is computed (worth pipelining)
    mixed_steps: bool                   # decode_submit takes prefill chunks (worth mixing: shared weight reads)
    max_segments: int                   # chunks of distinct sequences one step takes at most
    penalties_on_device: bool           # the step applies each row's repetition / presence / frequency penalties
                                        # itself (init_penalties first); else such rows are sampled on the host
    feeds_sampled: bool                 # a step row may feed the token the previous step sampled for its
                                        # sequence, on the device (StepRow.token None)
    samples_chunks: bool                # a mixed step samples a prompt-ending chunk's first token itself
                                        # (PrefillChunk.sample): its logits need not come to the host

    def new_sequence(self) -> int: ...
    def set_pages(self, sid: int, pages: list[int]) -> None:
        """The pages holding sid's KV in position order (page i holds positions i*page_size ...). Called
        whenever the list changes; it must cover every position a later prefill or decode writes."""
    def free(self, sid: int) -> None:
        """Forget sid (its slot); the pages stay with the block manager."""
    def prefill(self, sid: int, tokens: list[int], start: int, all_logits: bool = False) -> np.ndarray:
        """Write KV for `tokens` at positions start .. start+T-1 (positions < start must already hold KV:
        a cached prefix or earlier chunks) and return the logits of the last token [V], or of all [T, V]."""
    def decode(self, rows: list[StepRow]) -> StepResult:
        """One token for each row (1 .. max_batch rows): decode_collect(decode_submit(rows))."""
    def decode_submit(self, rows: list[StepRow], chunks: list[PrefillChunk] | None = None) -> Any:
        """Launch a decode step (with prefill chunks of other sequences: a mixed step); a handle for
        decode_collect. The rows' and the chunks' pages must already be set."""
    def decode_collect(self, handle: Any) -> StepResult:
        """Wait for the step `handle` launched and read its result."""
