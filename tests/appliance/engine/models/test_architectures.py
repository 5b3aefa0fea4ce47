"""Our Llama-family forward pass equals transformers' on tiny random checkpoints.

transformers is the outside reference: each checkpoint is built and saved by transformers' own
classes (see conftest.py), loaded by our loader, and driven the way the engine drives it: flat
varlen batches of several sequences, a paged KV cache whose blocks are scattered over the pool,
prefill, chunked prefill and decode steps. The reference runs each sequence alone, unpadded,
with no cache. Sequences reach position ~300 of 512 so rope scaling (whose original context is
64 tokens here) is exercised.
"""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from appliance.engine.block_manager import BlockManager
from appliance.engine.kv_cache import KVCacheSpec, KVPools
from appliance.engine.model_runner import ModelRunner
from appliance.engine.models.config import RopeConfig
from appliance.engine.models.decoder import CausalLM
from appliance.engine.models.loader import load_model
from appliance.engine.models.recurrent_state import allocate_states
from appliance.engine.models.rotary import cos_sin_table
from appliance.engine.sampling_params import SamplingParams
from appliance.engine.scheduler import Scheduler, SchedulerConfig
from appliance.engine.sequence import RequestId, Sequence, SequenceStatus
from kernels.ops import AttentionMetadata, RecurrentStateMetadata

from .conftest import VARIANTS

ATOL = 1e-4
# Far above float32 noise (~1e-6 here) and far below what a wrong rope table or a dropped bias
# does (>= 1e-1, checked by the tests named `..._would_fail_...`).
SEQ_LENS = (300, 161, 37)  # ragged; 161 = 10 blocks + 1 token
BLOCK_SIZE = 16


def _prompts(lengths: tuple[int, ...], seed: int = 1) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    vocab_size = 256
    return [torch.randint(vocab_size, (n,), generator=generator).tolist() for n in lengths]


@torch.inference_mode()
def _hf_logits(hf_model, prompt: list[int]) -> torch.Tensor:
    """transformers' logits at every position of `prompt`, run alone: [len, vocab]."""
    return hf_model(torch.tensor([prompt])).logits[0].float()


class PagedBatch:
    """Drives our model as the engine does, with hand-made block tables and slot mappings.

    Each sequence owns enough blocks for its whole length, taken from a shuffled pool, so
    logically consecutive blocks are physically scattered; in a hybrid model, a slot of the
    linear layers' recurrent state too (sequence i: slot num_seqs - i, so none is 0).
    """

    def __init__(self, model: CausalLM, prompts: list[list[int]], seed: int = 2):
        self.model = model
        self.prompts = prompts
        needed = [-(-len(p) // BLOCK_SIZE) for p in prompts]
        num_blocks = sum(needed) + 3  # spare blocks stay zero and unused
        spec = KVCacheSpec.for_model(model.config, BLOCK_SIZE, torch.float32)
        self.kv_caches = spec.allocate(KVPools(num_blocks), "cpu")
        pool = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed)).tolist()
        self.block_tables: list[list[int]] = []
        for n in needed:
            self.block_tables.append(pool[:n])
            pool = pool[n:]
        linear = model.config.linear_attention
        num_slots = len(prompts) + 1
        self.states = (
            [] if linear is None else allocate_states(linear, num_slots, torch.float32, "cpu")
        )

    @torch.inference_mode()
    def step(self, chunks: list[tuple[int, int, int]]) -> list[torch.Tensor]:
        """Run one forward over `chunks` of (sequence index, start, end): positions start..end-1
        of each, their earlier positions already cached. Returns each chunk's logits."""
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        for index, start, end in chunks:
            table = self.block_tables[index]
            input_ids += self.prompts[index][start:end]
            positions += range(start, end)
            slots += [
                table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(start, end)
            ]
        width = max(len(self.block_tables[i]) for i, _, _ in chunks)
        tables = [
            self.block_tables[i] + [0] * (width - len(self.block_tables[i])) for i, _, _ in chunks
        ]
        meta = AttentionMetadata.build(
            torch.tensor(slots, dtype=torch.int64),
            torch.tensor(tables, dtype=torch.int32),
            seq_lens=[end for _, _, end in chunks],
            query_lens=[end - start for _, start, end in chunks],
        )
        state_meta = RecurrentStateMetadata(
            state_slots=torch.tensor([len(self.prompts) - i for i, _, _ in chunks]),
            has_initial_state=torch.tensor([start > 0 for _, start, _ in chunks]),
            query_start_loc=torch.tensor([0, *itertools.accumulate(meta.query_lens)]),
            query_lens=meta.query_lens,
            decode_only=meta.decode_only,
        )
        hidden = self.model(
            torch.tensor(input_ids),
            torch.tensor(positions),
            self.kv_caches,
            meta,
            self.states,
            state_meta if self.states else None,
        )
        logits = self.model.compute_logits(hidden)
        return list(logits.split(meta.query_lens))


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def variant(request, tiny_checkpoints):
    """(our model, transformers' model, prompts, transformers' logits per prompt)."""
    model_dir, hf_model = tiny_checkpoints(request.param)
    prompts = _prompts(SEQ_LENS)
    reference = [_hf_logits(hf_model, p) for p in prompts]
    return load_model(model_dir), hf_model, prompts, reference


def _assert_close(ours: torch.Tensor, theirs: torch.Tensor, what: str) -> None:
    diff = (ours - theirs).abs().max().item()
    assert diff <= ATOL, f"{what}: max |logit difference| {diff:.2e} > {ATOL}"


def test_batched_prefill_logits_match_transformers_at_every_position(variant):
    model, _, prompts, reference = variant
    batch = PagedBatch(model, prompts)
    logits = batch.step([(i, 0, len(p)) for i, p in enumerate(prompts)])
    for i, (ours, theirs) in enumerate(zip(logits, reference, strict=True)):
        _assert_close(ours, theirs, f"sequence {i} of {len(prompts[i])} tokens")


def test_decode_steps_after_prefill_match_transformers_full_forward(variant):
    model, _, prompts, reference = variant
    num_decode_steps = 5
    batch = PagedBatch(model, prompts)
    prefill_ends = [len(p) - num_decode_steps for p in prompts]
    batch.step([(i, 0, end) for i, end in enumerate(prefill_ends)])
    for step in range(num_decode_steps):
        # Reverse the batch order on odd steps: rows must follow the metadata, not a fixed order.
        order = range(len(prompts)) if step % 2 == 0 else reversed(range(len(prompts)))
        chunks = [(i, prefill_ends[i] + step, prefill_ends[i] + step + 1) for i in order]
        for (i, start, _), ours in zip(chunks, batch.step(chunks), strict=True):
            _assert_close(ours[0], reference[i][start], f"decode of sequence {i} at {start}")


def test_chunked_prefill_across_two_steps_matches_transformers(variant):
    model, _, prompts, reference = variant
    long, mid, short = (len(p) for p in prompts)
    batch = PagedBatch(model, prompts)
    # Step 1: the first half of the long prompt and a block-aligned first chunk of the middle
    # one. Step 2: both second halves, alongside the whole short prompt.
    first = batch.step([(0, 0, long // 2), (1, 0, 64)])
    second = batch.step([(1, 64, mid), (2, 0, short), (0, long // 2, long)])
    _assert_close(torch.cat([first[0], second[2]]), reference[0], "long prompt in two chunks")
    _assert_close(torch.cat([first[1], second[0]]), reference[1], "middle prompt in two chunks")
    _assert_close(second[1], reference[2], "short prompt next to chunks")


@pytest.mark.parametrize(
    ("name", "wrong_rope"),
    [
        ("llama3.1", RopeConfig(theta=500000.0)),
        ("llama-linear-rope", RopeConfig(theta=10000.0)),
    ],
)
def test_comparison_would_fail_if_rope_scaling_were_ignored(tiny_checkpoints, name, wrong_rope):
    model_dir, hf_model = tiny_checkpoints(name)
    model = load_model(model_dir)
    key = (model.config.rope, model.config.head_dim)
    model.rope_tables = {key: cos_sin_table(wrong_rope, model.config.head_dim, 512)}
    prompt = _prompts((300,))
    ours = PagedBatch(model, prompt).step([(0, 0, 300)])[0]
    assert (ours - _hf_logits(hf_model, prompt[0])).abs().max() > 1000 * ATOL


@pytest.mark.parametrize("name", ["qwen2", "llama-attention-bias"])
def test_comparison_would_fail_if_attention_biases_were_dropped(tiny_checkpoints, name):
    model_dir, hf_model = tiny_checkpoints(name)
    model = load_model(model_dir)
    with torch.no_grad():
        for layer in model.layers:
            layer.self_attn.qkv_proj.bias.zero_()
    prompt = _prompts((100,))
    ours = PagedBatch(model, prompt).step([(0, 0, 100)])[0]
    assert (ours - _hf_logits(hf_model, prompt[0])).abs().max() > 1000 * ATOL


@torch.inference_mode()
def _hf_greedy(hf_model, prompt: list[int], num_new_tokens: int) -> list[int]:
    """Plain greedy decoding: a full forward for every new token, no cache."""
    tokens = list(prompt)
    for _ in range(num_new_tokens):
        tokens.append(int(hf_model(torch.tensor([tokens])).logits[0, -1].argmax()))
    return tokens[len(prompt) :]


def test_greedy_through_model_runner_and_scheduler_matches_transformers(tiny_checkpoints):
    """The real ModelRunner.execute fed by the real Scheduler: a small token budget chunks the
    prefills, and two prompts share 48 tokens so the second can hit the prefix cache."""
    model_dir, hf_model = tiny_checkpoints("llama3.1")
    num_new_tokens = 12
    shared = _prompts((48,), seed=3)[0]
    prompts = [*_prompts((5, 130), seed=4), shared + _prompts((70,), seed=5)[0]]
    prompts.append(shared + _prompts((20,), seed=6)[0])
    model = load_model(model_dir)
    num_blocks = 64
    spec = KVCacheSpec.for_model(model.config, BLOCK_SIZE, torch.float32)
    runner = ModelRunner(model, BLOCK_SIZE, "cpu", max_model_len=512)
    runner.set_kv_caches(spec.allocate(KVPools(num_blocks), "cpu"))
    scheduler = Scheduler(
        SchedulerConfig(max_model_len=512, max_num_seqs=8, max_num_batched_tokens=48),
        BlockManager(num_blocks, BLOCK_SIZE),
    )
    params = SamplingParams(temperature=0.0, max_tokens=num_new_tokens, ignore_eos=True)
    seqs = [
        Sequence(request_id=RequestId(f"r{i}"), token_ids=list(p), params=params, arrival=i)
        for i, p in enumerate(prompts)
    ]
    for seq in seqs:
        scheduler.add(seq)
    num_steps = 0
    while scheduler.num_unfinished:
        chunks = scheduler.schedule().chunks
        num_steps += 1
        results = runner.execute(chunks, [None] * len(chunks))
        for chunk, result in zip(chunks, results, strict=True):
            if not result.token_ids:
                continue
            chunk.seq.append_token(*result.token_ids)
            if chunk.seq.num_output_tokens == num_new_tokens:
                scheduler.finish(chunk.seq, SequenceStatus.FINISHED_LENGTH)
    assert num_steps > num_new_tokens, "the token budget should have chunked some prefill"
    assert scheduler.num_prefix_hit_tokens > 0, "the shared prefix should have been reused"
    for prompt, seq in zip(prompts, seqs, strict=True):
        assert seq.output_token_ids == _hf_greedy(hf_model, prompt, num_new_tokens), (
            f"greedy output for a prompt of {len(prompt)} tokens diverged from transformers"
        )


def test_building_a_model_imports_no_compiler():
    """A fresh process builds the model without importing torch._dynamo: nn.Embedding's random
    init imports it at first use (seconds of every cold start, W5 in docs/BENCHMARKS.md), so the
    model gives the embedding its empty weight instead. Would fail if the init came back."""
    code = (
        "import sys, torch\n"
        "from appliance.engine.models.config import ModelConfig\n"
        "from appliance.engine.models.decoder import CausalLM\n"
        "config = ModelConfig.from_dict({'architectures': ['Gemma3ForCausalLM'],"
        " 'hidden_size': 64, 'intermediate_size': 128, 'num_hidden_layers': 2,"
        " 'num_attention_heads': 4, 'num_key_value_heads': 2, 'head_dim': 16,"
        " 'vocab_size': 512, 'max_position_embeddings': 256, 'sliding_window': 32})\n"
        "with torch.device('meta'):\n"
        "    CausalLM(config)\n"
        "print(sorted(m for m in sys.modules if m.startswith('torch._dynamo'))[:1])\n"
    )
    root = Path(__file__).resolve().parents[4]
    env = {**os.environ, "PYTHONPATH": str(root)}
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=root, check=True
    )
    assert done.stdout.strip() == "[]"
