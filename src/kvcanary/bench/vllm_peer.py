"""vLLM as a peer of ``kvcanary bench engine``: a worker process in vLLM's own venv, and the
client that drives it.

vLLM's CPU build pins transformers < 5.20, so it lives in ``.venv-vllm`` (``make
test-vllm``; kvcanary installed there with ``--no-deps``) and runs as a subprocess::

    <venv-vllm>/bin/python -m kvcanary.bench.vllm_peer --model DIR --max-model-len N \\
        --max-num-seqs B

Protocol, one JSON object per line:

    worker -> {"ready": true, "vllm": "<version>", "threads": n}   built and warmed up
    client -> {"prompts": [[id, ...], ...], "max_tokens": n}
    worker -> {"seconds": s, "outputs": [[id, ...], ...]}  s: the generate call only
    client -> {"stop": true}  (or EOF)                      the worker exits

The worker's fd 1 is pointed at stderr before vLLM loads, so vLLM's own output never
reaches the protocol; it imports only vLLM and the standard library. Greedy, eager, float32,
no prefix caching (every repeat computes its prompts), ``VLLM_CPU_KVCACHE_SPACE=1`` (GiB)
unless set.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Any

# ------------------------------------------------------------------ client (our venv)


class VllmPeerError(RuntimeError):
    """The worker failed to start or answer; the message ends with its stderr tail."""


class VllmPeer:
    """A running worker (started once: its start-up stays out of every timed region)."""

    def __init__(self, python: str, model_dir: str, *, max_model_len: int, max_num_seqs: int,
                 max_num_batched_tokens: int | None = None, threads: int | None = None,
                 start_timeout_s: float = 600.0) -> None:  # fmt: skip
        """``max_num_batched_tokens``: tokens per forward (prefill chunks; None: vLLM's
        default). ``threads``: the worker's torch threads (``OMP_NUM_THREADS``; None: its own
        choice). The worker runs engine and model in one process, where vLLM binds no
        cores; ``self.threads`` is what it ended up with."""
        env = dict(os.environ)
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        if threads is not None:
            env["OMP_NUM_THREADS"] = str(threads)
        self._stderr = tempfile.TemporaryFile()  # noqa: SIM115 -- closed by close()
        budget = [] if max_num_batched_tokens is None else [
            "--max-num-batched-tokens", str(max_num_batched_tokens)]  # fmt: skip
        self._proc = subprocess.Popen(
            [python, "-m", "kvcanary.bench.vllm_peer", "--model", model_dir,
             "--max-model-len", str(max_model_len), "--max-num-seqs", str(max_num_seqs), *budget],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._stderr, env=env, text=True,
        )  # fmt: skip
        ready = self._read(start_timeout_s)
        self.version = str(ready.get("vllm", "?"))
        self.threads = int(ready.get("threads", 0))

    def generate(self, prompts: Sequence[Sequence[int]], max_tokens: int) -> tuple[float, list[list[int]]]:
        """Greedy ``max_tokens`` new tokens per prompt: (seconds of vLLM's generate, outputs)."""
        self._send({"prompts": [list(p) for p in prompts], "max_tokens": max_tokens})
        reply = self._read(None)
        return float(reply["seconds"]), [list(map(int, o)) for o in reply["outputs"]]

    def close(self) -> None:
        if self._proc.poll() is None:
            try:
                self._send({"stop": True})
                self._proc.wait(timeout=60)
            except (OSError, subprocess.TimeoutExpired):
                self._proc.kill()
                self._proc.wait()
        self._stderr.close()

    def __enter__(self) -> VllmPeer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _send(self, message: dict[str, Any]) -> None:
        stdin = self._proc.stdin
        assert stdin is not None  # noqa: S101 -- Popen(stdin=PIPE)
        try:
            stdin.write(json.dumps(message) + "\n")
            stdin.flush()
        except OSError as e:
            raise self._error(f"cannot write to the worker ({e})") from None

    def _read(self, timeout_s: float | None) -> dict[str, Any]:
        stdout = self._proc.stdout
        assert stdout is not None  # noqa: S101 -- Popen(stdout=PIPE)
        if timeout_s is not None:
            import selectors

            with selectors.DefaultSelector() as sel:
                sel.register(stdout, selectors.EVENT_READ)
                if not sel.select(timeout_s):
                    self._proc.kill()
                    raise self._error(f"no answer within {timeout_s:.0f} s")
        line = stdout.readline()
        if not line:
            self._proc.wait()
            raise self._error(f"the worker exited (status {self._proc.returncode})")
        reply = json.loads(line)
        if "error" in reply:
            raise self._error(str(reply["error"]))
        return dict(reply)

    def _error(self, what: str) -> VllmPeerError:
        self._stderr.seek(0)
        tail = self._stderr.read()[-2000:].decode(errors="replace").strip()
        return VllmPeerError(f"vLLM worker: {what}; its stderr ends:\n{tail}")


# ------------------------------------------------------------------ worker (.venv-vllm)


def _honor_layer_types() -> None:
    """vLLM 0.32's Qwen3 gives no layer a window of its own: with mixed ``layer_types`` every
    layer would attend to the whole context (vLLM sets the engine-wide window only when all
    layers slide). Give each sliding layer the config's window, as transformers does."""
    from vllm.model_executor.models import qwen3
    from vllm.model_executor.models.utils import extract_layer_index

    init = qwen3.Qwen3DecoderLayer.__init__

    def init_with_window(self: Any, config: Any, *args: Any, prefix: str = "", **kw: Any) -> None:
        types = getattr(config, "layer_types", None) or ()
        sliding = bool(types) and types[extract_layer_index(prefix)] == "sliding_attention"
        if sliding and kw.get("per_layer_sliding_window") is None:
            kw["per_layer_sliding_window"] = config.sliding_window
        init(self, config, *args, prefix=prefix, **kw)

    qwen3.Qwen3DecoderLayer.__init__ = init_with_window


def _serve(args: argparse.Namespace, out: IO[str]) -> None:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the patch is in-process
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    import torch
    import vllm
    from vllm import LLM, SamplingParams

    _honor_layer_types()
    config = json.loads((Path(args.model) / "config.json").read_text())
    llm = LLM(
        model=args.model, skip_tokenizer_init=True, dtype="float32", enforce_eager=True, seed=0,
        max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens, enable_prefix_caching=False, disable_log_stats=True,
        # transformers ignores max_window_layers once layer_types is given; vLLM's Qwen2/3
        # asserts it equals the layer count for mixed layer types.
        hf_overrides={"max_window_layers": config["num_hidden_layers"]},
    )  # fmt: skip

    def generate(prompts: list[list[int]], max_tokens: int) -> tuple[float, list[list[int]]]:
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        t0 = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return time.perf_counter() - t0, [list(o.outputs[0].token_ids) for o in outs]

    generate([[i % 256 for i in range(args.max_model_len // 2)]], 4)  # warm-up: first calls are slow
    _reply(out, {"ready": True, "vllm": vllm.__version__, "threads": torch.get_num_threads()})
    for line in sys.stdin:
        request = json.loads(line)
        if request.get("stop"):
            break
        seconds, outputs = generate(request["prompts"], int(request["max_tokens"]))
        _reply(out, {"seconds": seconds, "outputs": outputs})


def _reply(out: IO[str], message: dict[str, Any]) -> None:
    out.write(json.dumps(message) + "\n")
    out.flush()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="HF checkpoint directory (no tokenizer needed)")
    ap.add_argument("--max-model-len", type=int, required=True)
    ap.add_argument("--max-num-seqs", type=int, required=True)
    ap.add_argument("--max-num-batched-tokens", type=int, default=None)
    args = ap.parse_args(argv)
    out = os.fdopen(os.dup(1), "w")  # the protocol; fd 1 becomes stderr for everything else
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    try:
        _serve(args, out)
    except Exception as e:  # noqa: BLE001 -- reported to the client, which raises it
        _reply(out, {"error": f"{type(e).__name__}: {e}"})
        raise
    return 0


if __name__ == "__main__":
    sys.exit(main())
