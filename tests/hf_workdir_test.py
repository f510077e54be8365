"""Tests of kda_lm/hf/workdir.py: a Hugging Face checkpoint imported into a
run directory trains, generates and exports back."""

import json
import os
import shutil

import helpers
import jax
import kda_support
import ml_collections
import numpy as np
import process_support
import pytest
import tokenizers

from configs import ling3
from data import pipeline
from data import tokenizer as tokenizer_lib
from kda_lm import config as config_lib
from kda_lm import hf
from kda_lm.checkpoint import manager as manager_lib
from kda_lm.checkpoint import workdir as workdir_lib
from kda_lm.hf import workdir as hf_workdir
from kda_lm.infer import decoding, generate
from kda_lm.parallel import sharding
from kda_lm.train import loop as train_loop
from kda_lm.train import state as state_lib
from testbed import corpora

FIXTURE = os.path.join(process_support.REPO, "tests", "testdata", "hf",
                       "bailing_hybrid")

# Tiny shapes: compilation dominates (conftest.fast_compile).
pytestmark = pytest.mark.usefixtures("fast_compile")


def assert_same_tree(got, want, what):
  assert jax.tree.structure(got) == jax.tree.structure(want), what
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    kda_support.assert_same(a, b, what)


def test_import_train_export_import(tmp_path):
  workdir, out = str(tmp_path / "run"), str(tmp_path / "export")
  base = helpers.tiny_train_config(
      str(tmp_path / "data"), train__num_steps=5, train__log_every=5,
      eval__every_steps=0, checkpoint__every_steps=5,
      checkpoint__async_save=False)
  # The source's token ids and other unmodelled fields survive the trip.
  source = str(tmp_path / "source")
  shutil.copytree(FIXTURE, source)
  with open(os.path.join(source, "config.json")) as f:
    source_config = json.load(f)
  carried = dict(bos_token_id=1, eos_token_id=[2, 3], pad_token_id=0,
                 model_max_length=4096, use_cache=False)
  with open(os.path.join(source, "config.json"), "w") as f:
    json.dump(dict(source_config, **carried), f)
  hf_workdir.import_checkpoint(source, workdir, base)
  with pytest.raises(ValueError, match="already holds a run"):
    hf_workdir.import_checkpoint(FIXTURE, workdir, base)
  _, imported = hf.load_pretrained(FIXTURE)
  start = state_lib.load_run(workdir)
  assert start.step == 0
  assert_same_tree(start.params, imported, "step-0 parameters")
  # The rest of step 0 is a fresh run's (one init: the same rng split).
  cfg = config_lib.check_config(start.config)
  manager = manager_lib.CheckpointManager(workdir_lib.checkpoint_dir(workdir))
  state = manager.restore(state_lib.abstract_state(
      cfg, sharding.make_mesh(cfg.mesh)))
  manager.close()
  init = state_lib.run_state_layout(cfg, sharding.make_mesh(cfg.mesh)).init
  fresh = init(jax.random.PRNGKey(cfg.train.seed))
  np.testing.assert_array_equal(state.rng, fresh.rng)
  assert_same_tree(state.opt_state, jax.jit(init)(
      jax.random.PRNGKey(cfg.train.seed), imported).opt_state,
                   "step-0 optimizer state")
  # Fine-tuning resumes the imported run (configs/ling3.py:imported=W).
  state = train_loop.train_and_evaluate(
      ling3.get_config(f"imported={workdir}"), workdir)
  assert int(jax.device_get(state.step)) == 5
  run = hf_workdir.export_checkpoint(workdir, out)
  assert run.step == 5
  with open(os.path.join(out, "config.json")) as f:
    exported = json.load(f)
  assert {k: exported.get(k) for k in carried} == carried
  _, params = hf.load_pretrained(out)
  assert_same_tree(params, run.params, "re-imported parameters")
  moved = [np.any(np.asarray(a) != np.asarray(b)) for a, b in zip(
      jax.tree.leaves(params), jax.tree.leaves(imported), strict=True)]
  assert any(moved)
  text = generate.continue_prompt(
      run, "1 2 3 4", 3, None, sampling=decoding.SamplingConfig())
  assert len(text.split()) == 3, text


def test_generate_encodes_with_an_imported_tokenizer(tmp_path):
  """A `tokenizer.json` in the workdir (as the import copies it) is the
  text codec of `generate --prompt`."""
  tok = tokenizer_lib.train(["hello world, hello there"] * 4, 260)
  tok.save(str(tmp_path / state_lib.HF_TOKENIZER_FILES[0]))
  run = state_lib.Run(str(tmp_path), ml_collections.ConfigDict(
      {"data": {"name": "delayed_copy"}}), None, 0)
  codec = generate.text_codec(run)
  ids = codec.encode("hello world")
  assert ids == tok.encode("hello world").ids and max(ids) >= 256
  assert codec.decode(ids) == "hello world"
  os.remove(tmp_path / state_lib.HF_TOKENIZER_FILES[0])
  assert generate.text_codec(run) is None


def _text_run(tmp_path, **data):
  """A `Run` (no parameters) of a JSONL corpus with `data`'s settings."""
  corpus = tmp_path / "corpus.jsonl"
  corpus.write_text("".join(json.dumps({"text": t}) + "\n"
                            for t in corpora.corpus_texts(40)))
  config = ml_collections.ConfigDict({"data": dict(
      pipeline.default_config().to_dict(), name="jsonl", files=str(corpus),
      data_dir=str(tmp_path / "data"), **data)})
  return state_lib.Run(str(tmp_path / "run"), config, None, 0)


@pytest.mark.parametrize("kind", ["bytes", "bpe", "imported", "token_ids"])
def test_export_writes_the_runs_tokenizer(tmp_path, kind):
  """Beside an export: a byte-level tokenizer.json whose ids are the bytes
  (bytes runs), the run's own BPE file, an imported checkpoint's files as
  they came, or nothing (token ids); with a tokenizer_config.json that
  lets `transformers.AutoTokenizer` load it."""
  out = tmp_path / "export"
  out.mkdir()
  if kind == "token_ids":
    run = state_lib.Run(str(tmp_path), ml_collections.ConfigDict(
        {"data": {"name": "delayed_copy"}}), None, 0)
  elif kind == "imported":
    run = _text_run(tmp_path)
    os.makedirs(run.workdir)
    tokenizer_lib.train(["hello world"] * 4, 260).save(
        os.path.join(run.workdir, "tokenizer.json"))
    with open(os.path.join(run.workdir, "tokenizer_config.json"), "w") as f:
      json.dump({"tokenizer_class": "LlamaTokenizer", "bos_token": "<s>"}, f)
  else:
    run = _text_run(tmp_path, tokenizer=kind, bpe_vocab_size=300)
  hf_workdir.write_tokenizer(state_lib.run_tokenizer(run), str(out))
  written = out / "tokenizer.json"
  if kind == "token_ids":
    assert not os.listdir(out)
    return
  tok = tokenizers.Tokenizer.from_file(str(written))
  text = "héllo, wörld ∑"
  with open(out / "tokenizer_config.json") as f:
    tok_config = json.load(f)
  if kind == "bytes":
    assert tok.encode(text).ids == list(text.encode())
  if kind == "bpe":
    own = generate.text_codec(run)
    assert tok.encode(text).ids == own.encode(text)
    assert len(tok.encode(text).ids) < len(text.encode())
  if kind == "imported":
    assert written.read_bytes() == open(
        os.path.join(run.workdir, "tokenizer.json"), "rb").read()
    assert tok_config["tokenizer_class"] == "LlamaTokenizer"
  else:
    assert tok_config["tokenizer_class"] == "PreTrainedTokenizerFast"
  assert tok.decode(tok.encode(text).ids) == text
