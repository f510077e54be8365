"""Tests of kda_lm/hf/workdir.py: a Hugging Face checkpoint imported into a
run directory trains, generates and exports back."""

import json
import logging
import os
import re
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
from kda_lm.hf import formats
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
  # The rest of step 0 is a fresh run's: `init` from the run's key with
  # the imported parameters (whose rng is split as a fresh run's is:
  # train_state_test.py).
  cfg = config_lib.check_config(start.config)
  manager = manager_lib.CheckpointManager(workdir_lib.checkpoint_dir(workdir))
  state = manager.restore(state_lib.abstract_state(
      cfg, sharding.make_mesh(cfg.mesh)))
  manager.close()
  init = state_lib.run_state_layout(cfg, sharding.make_mesh(cfg.mesh)).init
  fresh = jax.jit(init)(state_lib.init_key(cfg), imported)
  np.testing.assert_array_equal(state.rng, fresh.rng)
  assert_same_tree(state.opt_state, fresh.opt_state, "step-0 optimizer state")
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


# The tokenizer files, the refusals and the export's arguments, with
# stand-in tokenizer files and runs (no training: the mutation session's
# selection, see docs/testing.md), then one import on its own.

TOKENIZER, TOKENIZER_CONFIG, SPECIAL = state_lib.HF_TOKENIZER_FILES
DEFAULT_TOKENIZER_CONFIG = """{
  "tokenizer_class": "PreTrainedTokenizerFast",
  "clean_up_tokenization_spaces": false
}"""


def write_files(folder, texts):
  """Writes {file name: text} into a folder."""
  os.makedirs(folder, exist_ok=True)
  for name, text in texts.items():
    with open(os.path.join(folder, name), "w") as f:
      f.write(text)


def read_files(folder):
  """{file name: text} of a folder's files."""
  out = {}
  for name in sorted(os.listdir(folder)):
    if os.path.isdir(os.path.join(folder, name)):
      continue
    with open(os.path.join(folder, name)) as f:
      out[name] = f.read()
  return out


def test_write_tokenizer_of_each_kind_of_run(tmp_path, caplog):
  """Stand-in files, copied byte for byte: a released tokenizer.json brings
  the tokenizer files of its folder (and no others), any other file is
  copied alone as tokenizer.json; a tokenizer_config.json is added where
  none came; bytes get a byte-level tokenizer; token ids get nothing."""
  released = str(tmp_path / "sources" / "released")
  write_files(released, {TOKENIZER: "released", SPECIAL: "special",
                         TOKENIZER_CONFIG: "theirs", "vocab.txt": "other"})
  own = str(tmp_path / "sources" / "own")
  write_files(own, {TOKENIZER: "bpe", TOKENIZER_CONFIG: "not copied",
                    "hub.json": "released elsewhere",
                    "vocab.json": "released too"})
  default = DEFAULT_TOKENIZER_CONFIG
  cases = {
      "released": (os.path.join(released, TOKENIZER), True,
                   {TOKENIZER: "released", TOKENIZER_CONFIG: "theirs",
                    SPECIAL: "special"}),
      # Names sorting before and after tokenizer.json.
      "released_other_name": (os.path.join(own, "hub.json"), True,
                              {TOKENIZER: "released elsewhere",
                               TOKENIZER_CONFIG: default}),
      "released_later_name": (os.path.join(own, "vocab.json"), True,
                              {TOKENIZER: "released too",
                               TOKENIZER_CONFIG: default}),
      "bpe": (os.path.join(own, TOKENIZER), False,
              {TOKENIZER: "bpe", TOKENIZER_CONFIG: default}),
  }
  for kind, (path, is_released, want) in cases.items():
    out = str(tmp_path / kind)
    os.makedirs(out)
    hf_workdir.write_tokenizer(state_lib.RunTokenizer(path, is_released), out)
    assert read_files(out) == want, kind
  out = str(tmp_path / "bytes")
  os.makedirs(out)
  hf_workdir.write_tokenizer(state_lib.RunTokenizer("", False), out)
  written = read_files(out)
  assert sorted(written) == [TOKENIZER, TOKENIZER_CONFIG]
  assert written[TOKENIZER_CONFIG] == DEFAULT_TOKENIZER_CONFIG
  text = "héllo ∑"
  tok = tokenizers.Tokenizer.from_file(os.path.join(out, TOKENIZER))
  assert tok.encode(text).ids == list(text.encode())
  out = str(tmp_path / "token_ids")
  os.makedirs(out)
  caplog.set_level(logging.INFO)
  hf_workdir.write_tokenizer(None, out)
  assert not os.listdir(out)
  assert "The run is on token ids: no tokenizer exported." in caplog.text


def test_import_refusals_come_first(tmp_path):
  """A workdir holding a run is refused before the checkpoint is read; a
  folder without one goes on to read it."""
  base = helpers.tiny_train_config(str(tmp_path / "data"))
  workdir = str(tmp_path / "run")
  os.makedirs(workdir)
  with pytest.raises(ValueError, match="has no config.json"):
    hf_workdir.import_checkpoint(str(tmp_path / "nothing"), workdir, base)
  workdir_lib.write_config(workdir, {"model": {}}, step=0)
  with pytest.raises(ValueError, match=f"^{re.escape(workdir)} already "
                     f"holds a run; import into a new --workdir.$"):
    hf_workdir.import_checkpoint(FIXTURE, workdir, base)
  with pytest.raises(TypeError):
    hf_workdir.import_checkpoint(FIXTURE, workdir, base, "float32")


def _stand_in_run(workdir, monkeypatch):
  """A `Run` of the fixture's parameters at step 3, returned by
  `state.load_run(workdir)`."""
  model_config, params = hf.load_pretrained(FIXTURE)
  run = state_lib.Run(workdir, ml_collections.ConfigDict(
      {"data": {"name": "delayed_copy"}}), params, 3, model_config)
  loaded = []

  def load_run(path):
    loaded.append(path)
    return run

  monkeypatch.setattr(state_lib, "load_run", load_run)
  return run, loaded


def test_export_carries_the_source_config_and_its_arguments(tmp_path,
                                                             monkeypatch):
  workdir = str(tmp_path / "run")
  os.makedirs(workdir)
  run, loaded = _stand_in_run(workdir, monkeypatch)
  out = str(tmp_path / "plain")
  assert hf_workdir.export_checkpoint(workdir, out) is run
  assert loaded == [workdir]
  with open(os.path.join(out, "config.json")) as f:
    exported = json.load(f)
  assert exported["model_type"] == "bailing_hybrid"
  assert exported["bos_token_id"] is None
  assert sorted(os.listdir(out)) == ["config.json", "model.safetensors"]
  with open(os.path.join(FIXTURE, "config.json")) as f:
    source = json.load(f)
  with open(os.path.join(workdir, hf_workdir.SOURCE_CONFIG), "w") as f:
    json.dump(dict(source, bos_token_id=5, use_cache=False), f)
  out = str(tmp_path / "carried")
  hf_workdir.export_checkpoint(workdir, out, max_shard_size=20_000)
  with open(os.path.join(out, "config.json")) as f:
    exported = json.load(f)
  assert exported["bos_token_id"] == 5 and exported["use_cache"] is False
  assert os.path.isfile(os.path.join(out, "model.safetensors.index.json"))
  with pytest.raises(ValueError, match="cannot express model.kda_gate"):
    hf_workdir.export_checkpoint(workdir, out, model_type="kimi_linear")
  with pytest.raises(TypeError):
    hf_workdir.export_checkpoint(workdir, out, "5GB")


def test_import_writes_a_step_0_run_with_the_source_files(tmp_path):
  """Into an existing empty folder: the step-0 checkpoint of the
  checkpoint's parameters (unscanned by default), the config recorded as
  starting at step 0, the source config.json (its keys sorted) and the
  tokenizer files the checkpoint has."""
  source = str(tmp_path / "source")
  shutil.copytree(FIXTURE, source)
  with open(os.path.join(FIXTURE, "config.json")) as f:
    hf_config = json.load(f)
  with open(os.path.join(source, "config.json"), "w") as f:
    json.dump(dict(reversed(hf_config.items())), f)   # Its keys unsorted.
  write_files(source, {TOKENIZER: "tokenizer", SPECIAL: "special",
                       "vocab.txt": "other"})
  workdir = str(tmp_path / "run")
  os.makedirs(workdir)
  base = helpers.tiny_train_config(str(tmp_path / "data"),
                                   checkpoint__async_save=False)
  config = hf_workdir.import_checkpoint(source, workdir, base)
  assert not config.model.scan_layers
  assert config.model.to_dict() == dict(
      formats.from_hf(hf_config).to_dict(), scan_layers=False)
  files = read_files(workdir)
  assert files[hf_workdir.SOURCE_CONFIG] == json.dumps(
      hf_config, indent=2, sort_keys=True)
  assert files[TOKENIZER] == "tokenizer" and files[SPECIAL] == "special"
  assert TOKENIZER_CONFIG not in files and "vocab.txt" not in files
  history = [json.loads(line) for line in
             files[workdir_lib.HISTORY_FILE].splitlines()]
  assert [h["start_step"] for h in history] == [0]
  manager = manager_lib.CheckpointManager(workdir_lib.checkpoint_dir(workdir))
  assert manager.all_steps() == [0]
  manager.close()
  run = state_lib.load_run(workdir)
  assert run.step == 0
  _, imported = hf.load_pretrained(FIXTURE)
  assert_same_tree(run.params, imported, "step-0 parameters")
