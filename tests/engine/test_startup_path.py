"""What an engine start does before the first request, and in what order.

- The frontend (the API server process) builds the configuration without importing torch:
  the model's config, architecture, activation, rope and pooler are checked from the
  registry's table (``registry.ModelEntry``) and config.json, so the workers start at once.
- The tokenizer (transformers' import alone takes seconds) loads on a thread while the workers
  start; a tokenizer that cannot load still fails the start with its own error, and the
  workers already started are reaped; a worker that refuses to start fails it only once the
  tokenizer's thread has ended (none is left importing transformers behind the caller).
- A worker allocates the meta-built model with ``torch.empty`` (``loader._materialize``), not
  ``Module.to_empty``, whose meta path imports sympy; a parameter two modules share stays
  shared.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from torch import nn

from trillm.engine.llm import LLM
from trillm.model_executor import loader, registry

REPO = Path(__file__).resolve().parents[2]


def run_python(code: str) -> str:
    """``code`` in a fresh interpreter (nothing imported yet); its stdout."""
    env = dict(os.environ, PYTHONPATH=str(REPO))
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return done.stdout


def test_the_frontend_builds_its_config_without_torch(tiny_model_factory):
    """Llama and GPT-NeoX (a gelu MLP over a partial rotary embedding: the registry's
    entries, not the model classes, say they run) configs built for TP=2 x PP=2 (the shapes'
    split checked), the server modules imported: torch is not loaded."""
    llama = tiny_model_factory("llama")
    neox = tiny_model_factory("gpt_neox")
    out = run_python(f"""
        import sys
        import trillm.engine.engine_startup, trillm.entrypoints.openai.api_server
        from trillm.config import EngineArgs
        from trillm.engine.config_builder import build_config
        for path in ({llama!r}, {neox!r}):
            config = build_config(EngineArgs(path, max_model_len=64, tensor_parallel_size=2,
                                             pipeline_parallel_size=2))
            print(config.model.architecture, config.model.hidden_act, config.device)
        print("torch" in sys.modules)
    """)
    assert out.split("\n")[:3] == [
        "LlamaForCausalLM silu cpu",
        "GPTNeoXForCausalLM gelu cpu",
        "False",
    ]


def test_the_torch_free_tables_match_the_modules_they_describe():
    """Gemma's activations are the names its MLP maps to F.gelu's ``approximate``; every
    registry entry names a class that exists; the GGUF loader's K-quant types are the ones
    ``gguf_kquants`` dequantizes."""
    from trillm.model_executor import gguf_kquants, gguf_loader
    from trillm.model_executor.models import gemma

    assert set(gguf_loader.KQUANT_TYPES) == set(gguf_kquants.BLOCK_BYTES)
    for arch in ("GemmaForCausalLM", "Gemma2ForCausalLM", "Gemma3ForCausalLM"):
        assert set(registry.model_entry(arch).activations) == set(gemma._GELU)
    for arch in registry.supported_architectures():
        assert registry.get_model_class(arch).__name__ == registry.model_entry(arch).class_name


def test_a_tokenizer_that_cannot_load_fails_the_start_and_reaps_the_workers(
    tiny_model_factory, tmp_path
):
    """The workers start while the tokenizer loads: its error is the start's error, and no
    worker process is left behind."""
    folder = tmp_path / "bad-tokenizer"
    shutil.copytree(tiny_model_factory("llama"), folder)
    (folder / "tokenizer.json").write_text("{not json")
    before = _workers()
    with pytest.raises(Exception, match="key must be a string at line 1 column 2"):
        LLM(str(folder), max_model_len=64, kv_cache_memory="4MiB")
    assert _workers() - before == set()


def test_a_refused_start_leaves_no_tokenizer_load_behind():
    """A worker that refuses to start (too few KV blocks for the context) fails the start once
    the tokenizer's thread has ended. Left running, that thread's first import of transformers,
    half done, broke the caller's next one (``cannot import name ... from 'transformers'``)."""
    out = run_python("""
        import threading
        from trillm import LLM
        from trillm.worker.kv_cache_sizing import KVCacheTooSmallError
        try:
            LLM(None, num_gpu_blocks_override=6, max_model_len=256, kv_cache_memory="16MiB",
                distributed_executor_backend="uni")
        except KVCacheTooSmallError:
            print([t.name for t in threading.enumerate() if t.name == "trillm-load"])
        from transformers import AutoTokenizer, PreTrainedTokenizerFast
        print("imported")
    """)
    assert out.split("\n")[:2] == ["[]", "imported"]


def test_the_start_fails_only_after_the_tokenizer_load_ended(monkeypatch):
    """The same order in this process, with a load slower than the refusal (torch imported)."""
    from trillm.engine import tokenizer_loader
    from trillm.worker.kv_cache_sizing import KVCacheTooSmallError

    real, ended = tokenizer_loader.load_tokenizer, []

    def slow_load(*args: object) -> object:
        time.sleep(2)
        ended.append(True)
        return real(*args)

    monkeypatch.setattr(tokenizer_loader, "load_tokenizer", slow_load)
    with pytest.raises(KVCacheTooSmallError):
        LLM(
            None,
            num_gpu_blocks_override=6,
            max_model_len=256,
            kv_cache_memory="16MiB",
            distributed_executor_backend="uni",
        )
    assert ended == [True]


def _workers() -> set[int]:
    """Live worker processes (``trillm.worker.worker_main``) started by this one (/proc)."""
    me, found = str(os.getpid()), set()
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            status = (proc / "status").read_text()
            cmdline = (proc / "cmdline").read_bytes()
        except OSError:
            continue
        fields = dict(line.split(":\t", 1) for line in status.splitlines() if ":\t" in line)
        live = not fields.get("State", "Z").startswith("Z")
        if fields.get("PPid", "").strip() == me and live and b"worker_main" in cmdline:
            found.add(int(proc.name))
    return found


def test_a_worker_builds_the_model_without_sympy(tiny_model_factory):
    """``build_model`` in a fresh process: the model's weights equal the checkpoint's, the
    tied head is the embedding, and sympy (``to_empty``'s meta path) was never imported."""
    path = tiny_model_factory("llama", tie_word_embeddings=True)
    out = run_python(f"""
        import sys
        import torch
        from safetensors.torch import load_file
        from trillm.attention.torch_backend import TorchAttentionBackend
        from trillm.config import EngineArgs
        from trillm.model_executor.loader import build_model, safetensors_files
        from trillm.model_executor.model_config import load_model_config
        cfg = load_model_config(EngineArgs({path!r}, device="cpu"))
        model = build_model(cfg, TorchAttentionBackend(), "cpu")
        ref = load_file(safetensors_files({path!r})[0])
        emb = model.model.embed_tokens.weight
        print(torch.equal(emb, ref["model.embed_tokens.weight"]),
              model.lm_head.weight is emb,
              all(p.device.type == "cpu" for p in model.parameters()),
              "sympy" in sys.modules)
    """)
    assert out.split() == ["True", "True", "True", "False"]


def test_materialize_keeps_a_shared_parameter_shared():
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4), nn.BatchNorm1d(4))
    model[1].weight = model[0].weight
    loader._materialize(model, "cpu")
    assert model[1].weight is model[0].weight
    assert isinstance(model[0].weight, nn.Parameter) and model[0].weight.requires_grad
    tensors = [*model.parameters(), *model.buffers()]
    assert tensors and all(t.device.type == "cpu" for t in tensors)
    assert model[2].running_mean.shape == (4,)


def test_a_frozen_startup_heap_is_skipped_and_new_garbage_still_collected():
    """``freeze_startup_heap`` (trillm/gc_heap.py) in a fresh process holding 200,000 tracked
    objects: afterwards the collector's generations hold almost none of them, and a reference
    cycle made later is still collected."""
    out = run_python("""
        import gc, weakref
        from trillm.gc_heap import freeze_startup_heap
        startup = [[i] for i in range(200_000)]  # lists are always tracked
        before = len(gc.get_objects())
        frozen = freeze_startup_heap("test")
        after = len(gc.get_objects())
        class Node: pass
        a, b = Node(), Node()
        a.other, b.other = b, a
        alive = weakref.ref(a)
        del a, b
        gc.collect()
        print(before, frozen, after, alive() is None, gc.isenabled(), len(startup))
    """)
    before, frozen, after, collected, enabled, kept = out.split()
    assert int(before) > 200_000 and int(frozen) > 200_000, out
    assert int(after) < int(before) // 50, out
    assert (collected, enabled, kept) == ("True", "True", "200000"), out


def test_a_worker_freezes_its_heap_once_its_cache_is_allocated():
    """The worker process's last start step (``InitKVCache``) freezes its heap before it answers
    ready: a Worker with a stand-in runner, in a fresh process."""
    out = run_python("""
        import gc
        from trillm.ipc.control import InitKVCache
        from trillm.worker.worker_main import Worker
        class Runner:
            def initialize_kv_cache(self, num_blocks): self.blocks = num_blocks
        sent = []
        worker = Worker(0, None, None, 0)
        worker.runner, worker._send = Runner(), sent.append
        before = gc.get_freeze_count()
        worker._handle(InitKVCache(7))
        print(before, gc.get_freeze_count() > 10_000, sent[0].phase, worker.runner.blocks)
    """)
    assert out.split() == ["0", "True", "kv_cache", "7"]
