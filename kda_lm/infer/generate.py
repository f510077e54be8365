r"""Samples from a trained run: `python -m kda_lm.infer.generate --workdir=...`.

Loads `<workdir>/config.json` and the newest checkpoint, then either

* continues `--prompt` (text for a `text_files` run, encoded by its
  tokenizer: bytes, or the run's BPE `tokenizer.json`, checked against the
  SHA-256 in its config; else token ids separated by spaces or commas) and
  prints the continuation (decoded back to text through the same
  tokenizer), or
* without `--prompt` on a delayed-copy run, prompts with the first `delay`
  tokens of held-out validation documents, generates the rest of each
  document greedily and prints `copy accuracy: NN.NN%` against the known
  answer (every later token repeats the one `delay` steps back).

  python -m kda_lm.infer.generate --workdir=runs/ling3_tiny
  python -m kda_lm.infer.generate --workdir=runs/ling3_tiny_text \
      --prompt="def main(" --max_new_tokens=200 --temperature=0.8 --top_p=0.95
"""

import functools
import sys
import time
from typing import Optional, Sequence

from absl import app, flags
import numpy as np

import kda_lm  # noqa: F401  # isort: skip  (first: XLA:CPU flags)
from data import tokenizer as tokenizer_lib
from kda_lm import logs
from kda_lm.infer import decoding
from kda_lm.train import state as state_lib


def text_codec(run: state_lib.Run) -> Optional[tokenizer_lib.TextCodec]:
  """The run's text codec (`state.run_tokenizer`: bytes, its BPE, a
  released model's tokenizer.json or an imported checkpoint's); None for
  runs that are not on text (token ids)."""
  tok = state_lib.run_tokenizer(run)
  if tok is None:
    return None
  if tok.released:
    return tokenizer_lib.TextCodec(hf_tokenizer_path=tok.path)
  return tokenizer_lib.TextCodec(tok.path)


def parse_prompt(prompt: str, codec: Optional[tokenizer_lib.TextCodec]
                 ) -> list[int]:
  """The prompt's token ids: encoded text, or integers (no codec).

  Raises:
    ValueError: an empty prompt or a non-integer id.
  """
  if codec is not None:
    ids = codec.encode(prompt)
  else:
    parts = prompt.replace(",", " ").split()
    try:
      ids = [int(p) for p in parts]
    except ValueError:
      raise ValueError(f"--prompt must be token ids separated by spaces or "
                       f"commas for this run, got {prompt!r}.") from None
  if not ids:
    raise ValueError("--prompt is empty.")
  return ids


def format_tokens(ids: Sequence[int],
                  codec: Optional[tokenizer_lib.TextCodec]) -> str:
  if codec is not None:
    return codec.decode(ids)
  return " ".join(str(i) for i in ids)


def _progress(done: int, seconds: float, rows: int) -> None:
  print(f"  {done} decode steps in {seconds:.1f} s after the first: "
        f"{done * rows / max(seconds, 1e-9):.1f} tokens/s", file=sys.stderr)


def throughput(stats: dict[str, float], rows: int) -> str:
  """One line from `decoding.generate`'s stats: prefill (compilation
  included) and decode tokens/s after the first step."""
  line = (f"prefill: {stats['prefill_tokens']} tokens in "
          f"{stats['prefill_s']:.2f} s (compilation included); first decode "
          f"step {stats['first_step_s']:.2f} s (compilation included)")
  if stats["decode_steps"]:
    rate = stats["decode_steps"] * rows / max(stats["decode_s"], 1e-9)
    line += (f"; then {stats['decode_steps']} steps x {rows} rows in "
             f"{stats['decode_s']:.2f} s: {rate:,.1f} tokens/s")
  return line


def _sampling() -> decoding.SamplingConfig:
  return decoding.SamplingConfig.from_options(
      temperature=_TEMPERATURE.value, top_k=_TOP_K.value,
      top_p=_TOP_P.value, seed=_SEED.value)


def continue_prompt(run: state_lib.Run, prompt: str, max_new_tokens: int,
                    max_len: Optional[int], *,
                    sampling: decoding.SamplingConfig,
                    end_token: Optional[int] = None) -> str:
  """The continuation of `prompt`, formatted."""
  codec = text_codec(run)
  ids = parse_prompt(prompt, codec)
  max_len = max_len or len(ids) + max_new_tokens - 1
  if len(ids) > max_len:
    raise ValueError(f"The prompt has {len(ids)} tokens, more than "
                     f"--max_len={max_len}.")
  decoder = decoding.Decoder(run.model, max_len)
  stats = {}
  out = decoding.generate(
      decoder, run.params, [ids], max_new_tokens=max_new_tokens,
      sampling=sampling, end_token=end_token,
      progress=functools.partial(_progress, rows=1), stats=stats)
  print(throughput(stats, 1), file=sys.stderr)
  return format_tokens(out[0], codec)


def validation_documents(run: state_lib.Run, num_docs: int) -> list[np.ndarray]:
  """The first `num_docs` validation documents' tokens."""
  from data import pipeline  # pylint: disable=g-import-not-at-top
  docs, _ = pipeline.load_documents(
      run.config.data, "validation",
      data_dir=pipeline.resolve_data_dir(run.config.data, run.workdir))
  return [np.asarray(d["tokens"]) for d in docs.take(num_docs)
          .as_numpy_iterator()]


def copy_accuracy(run: state_lib.Run, num_docs: int, batch_size: int
                  ) -> tuple[float, int, int]:
  """Greedy copy accuracy on held-out delayed-copy documents.

  Returns:
    (accuracy, tokens scored, documents).
  """
  delay = int(run.config.data.delay)
  docs = [d for d in validation_documents(run, num_docs) if len(d) > delay]
  if not docs:
    raise ValueError("No validation document is longer than the delay.")
  longest = max(len(d) for d in docs)
  decoder = decoding.Decoder(run.model, longest - 1)
  correct = total = 0
  start = time.time()
  for i in range(0, len(docs), batch_size):
    batch = docs[i:i + batch_size]
    new = longest - delay
    stats = {}
    out = decoding.generate(decoder, run.params,
                            [d[:delay].tolist() for d in batch],
                            max_new_tokens=new,
                            progress=functools.partial(
                                _progress, rows=len(batch)), stats=stats)
    print("  " + throughput(stats, len(batch)), file=sys.stderr)
    for doc, gen in zip(batch, out, strict=True):
      answer = doc[delay:]
      correct += int(np.sum(np.asarray(gen[:len(answer)]) == answer))
      total += len(answer)
    print(f"  {min(i + batch_size, len(docs))}/{len(docs)} documents, "
          f"{time.time() - start:.1f} s", file=sys.stderr)
  return correct / total, total, len(docs)


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}.")
  logs.quiet_library_logs()
  sampling = _sampling()  # Bad options fail before anything is loaded.
  run = state_lib.load_run(_WORKDIR.value)
  print(f"Loaded {run.workdir} at step {run.step}.", file=sys.stderr)
  if _PROMPT.value is not None:
    print(continue_prompt(run, _PROMPT.value, _MAX_NEW.value,
                          _MAX_LEN.value, sampling=sampling,
                          end_token=_END_TOKEN.value))
    return
  if run.config.data.name != "delayed_copy":
    raise app.UsageError("--prompt is required: this run is not a "
                         "delayed-copy run.")
  accuracy, tokens, docs = copy_accuracy(run, _NUM_DOCS.value, _BATCH.value)
  print(f"copy accuracy: {100 * accuracy:.2f}% ({tokens} tokens of {docs} "
        f"validation documents, greedy)")


if __name__ == "__main__":
  # Flags exist only in the program, so that importing the module (tests,
  # other tools with flags of the same names) defines none.
  _WORKDIR = flags.DEFINE_string("workdir", None,
                                 "The training run directory.")
  _PROMPT = flags.DEFINE_string(
      "prompt", None, "Text (text_files runs) or token ids; unset on a "
      "delayed-copy run: measure copy accuracy on validation documents.")
  _MAX_NEW = flags.DEFINE_integer(
      "max_new_tokens", 64, "Tokens to generate after --prompt.")
  _MAX_LEN = flags.DEFINE_integer(
      "max_len", None, "Cache slots per row (prompt + continuation); "
      "default exactly what is needed.")
  _TEMPERATURE = flags.DEFINE_float("temperature", 0.0, "0 = greedy.")
  _TOP_K = flags.DEFINE_integer("top_k", 0,
                                "Keep the k likeliest (0 = all).")
  _TOP_P = flags.DEFINE_float("top_p", 1.0,
                               "Nucleus probability (1 = off).")
  _SEED = flags.DEFINE_integer("seed", 0, "Sampling seed.")
  _END_TOKEN = flags.DEFINE_integer("end_token", None,
                                    "Stop a row after this token id.")
  _NUM_DOCS = flags.DEFINE_integer(
      "num_docs", 64, "Copy accuracy: validation documents to continue.")
  _BATCH = flags.DEFINE_integer("batch_size", 16,
                                "Copy accuracy: documents per batch.")
  flags.mark_flags_as_required(["workdir"])
  app.run(main)
