"""Tests of data/records.py on its own (no corpus format): the skipped
counts and their log lines, the errors of bad records and files, the
validation hold-out and process shards, the tokenizing function, the
sampled mean length, the BPE built from the training records, the file
order of `interleave` and `match_files`, and `tokenize_files`."""

import dataclasses
import hashlib
import os
import re
import time

import helpers
import numpy as np
import pytest
import tensorflow as tf

from data import records, text_files
from data import tokenizer as tokenizer_lib


@dataclasses.dataclass(frozen=True)
class _Listed(records.Settings):
  """A source of the records in `lines` (one "file", `mem.txt`, lines
  numbered from 1); the records at `missing` have no text field."""
  lines: tuple[bytes, ...] = ()
  missing: tuple[int, ...] = ()
  hold_out: bool = False
  sharded: bool = False
  UNIT = "line"

  def records(self, split, data_dir, process_index, process_count,
              skipped):
    del split, data_dir, process_index, process_count, skipped
    n = len(self.lines)
    present = [i not in self.missing for i in range(n)]
    lines = tf.data.Dataset.from_tensor_slices((
        tf.range(1, n + 1), tf.constant(self.lines, tf.string, [n]),
        tf.constant(present, tf.bool, [n])))
    return (lines.map(lambda i, line, p: records.record("mem.txt", i, line,
                                                        p)),
            self.hold_out, self.sharded)


class _Escaped(_Listed):
  """Texts with the bytes that are not UTF-8 as lone surrogates."""

  def text(self, record):
    return record.decode("utf-8", "surrogateescape")


def _lines(texts):
  return tuple(t.encode() if isinstance(t, str) else t for t in texts)


def _tokens(documents):
  return [d["tokens"].tolist() for d in documents.as_numpy_iterator()]


def _texts(documents):
  return [bytes(t).decode() for t in _tokens(documents)]


def _name(split):
  """`split` built at run time: equal to the literal, not the same object
  (as a split read from a command line)."""
  return "".join(list(split))


def _split_texts(settings, split, process_index, process_count):
  return [r["record"].decode() for r in settings._split_records(
      _name(split), "", process_index, process_count, None
  ).as_numpy_iterator()]


def _hash_buckets(lines):
  return tf.strings.to_hash_bucket_fast(list(lines), 100).numpy().tolist()


@pytest.fixture
def warnings(monkeypatch):
  """The formatted `logging.warning` lines of the module."""
  lines = []
  monkeypatch.setattr(records.logging, "warning",
                      lambda fmt, *args: lines.append(fmt % args))
  return lines


# Skipped, bad, Problem, utf8.


def test_skipped_counts_each_kind_and_a_file_once(warnings):
  skipped = records.Skipped()
  skipped.add("not_utf8", "a, line 1", "m")
  skipped.add("not_utf8", "a, line 1", "m")        # Read again: counted.
  skipped.add("empty_file", "b", "m", count=3, once=True)
  skipped.add("empty_file", "b", "m", count=3, once=True)   # Not again.
  skipped.add("empty_file", "c", "m", count=2, once=True)
  skipped.add("bad_file", "b", "m", once=True)     # Another kind of b.
  assert skipped.counts() == {"not_utf8": 2, "empty_file": 5,
                              "bad_file": 1}
  skipped.counts()["not_utf8"] = 7                 # A copy.
  assert skipped.metrics() == {
      "data/skipped_bad_file": 1.0, "data/skipped_empty_file": 5.0,
      "data/skipped_not_utf8": 2.0, "data/skipped_records": 8.0}
  assert list(skipped.metrics()) == [
      "data/skipped_bad_file", "data/skipped_empty_file",
      "data/skipped_not_utf8", "data/skipped_records"]
  assert warnings[0] == "Skipping a bad record (not_utf8): a, line 1: m."
  assert len(warnings) == 5
  # A place already counted without `once` is not counted again with it.
  skipped.add("not_utf8", "a, line 1", "m", once=True)
  assert skipped.counts()["not_utf8"] == 2
  assert records.Skipped().metrics() == {"data/skipped_records": 0.0}


def test_skipped_logs_ten_records_of_a_kind_then_only_counts(warnings):
  skipped = records.Skipped()
  for i in range(12):
    skipped.add("malformed_json", f"f, line {i}", "bad")
    skipped.add("not_utf8", f"f, line {i}", "bad", count=4)
  malformed = [w for w in warnings if "malformed_json" in w]
  assert malformed == [
      f"Skipping a bad record (malformed_json): f, line {i}: bad."
      for i in range(10)] + [
          "Further skipped records (malformed_json) are only counted."]
  # Counts of 4 reach 8, then 12: logged twice, never exactly at 10.
  assert [w for w in warnings if "not_utf8" in w] == [
      f"Skipping a bad record (not_utf8): f, line {i}: bad."
      for i in range(2)]
  assert skipped.counts() == {"malformed_json": 12, "not_utf8": 48}


def test_bad_raises_with_the_place_or_counts(warnings):
  with pytest.raises(records.BadRecordError) as error:
    records.bad("not_utf8", "/c/a.jsonl, line 7", "the text is not valid",
                None)
  assert str(error.value) == (
      "/c/a.jsonl, line 7: the text is not valid (set "
      "config.data.skip_bad_records=True to skip bad records).")
  assert isinstance(error.value, ValueError)
  skipped = records.Skipped()
  for _ in range(2):
    records.bad("empty_file", "/c/b.jsonl", "the file is empty", skipped,
                count=5, once=True)
  # A record is counted each time it is read (once per epoch).
  for _ in range(2):
    records.bad("missing_field", "/c/a.jsonl, line 8", "m", skipped)
  assert skipped.counts() == {"empty_file": 5, "missing_field": 2}
  assert warnings == [
      "Skipping a bad record (empty_file): /c/b.jsonl: the file is empty.",
      "Skipping a bad record (missing_field): /c/a.jsonl, line 8: m.",
      "Skipping a bad record (missing_field): /c/a.jsonl, line 8: m."]
  with pytest.raises(TypeError):    # `count` and `once` only by name.
    records.bad("empty_file", "/c/b.jsonl", "m", skipped, 5)


def test_utf8_and_problem():
  assert records.utf8("café".encode()) == "café"
  assert records.utf8(b"") == ""
  with pytest.raises(records.Problem) as error:
    records.utf8(b"caf\xe9")
  assert error.value.kind == "not_utf8"
  assert str(error.value) == "the text is not valid UTF-8"
  problem = records.Problem("missing_field", "no text field 'x'")
  assert (problem.kind, str(problem)) == ("missing_field",
                                          "no text field 'x'")


# named_bad_records and the tokenizing function.


def test_named_bad_records_names_only_its_own_errors():
  error = tf.errors.InvalidArgumentError(None, None, "some other failure")
  with pytest.raises(tf.errors.InvalidArgumentError) as raised:
    with records.named_bad_records():
      raise error
  assert raised.value is error
  with pytest.raises(KeyError):
    with records.named_bad_records():
      raise KeyError("not a pipeline error")
  with records.named_bad_records():
    pass


def test_a_bad_record_in_the_pipeline_is_raised_as_its_message():
  settings = _Listed(lines=_lines(["good", b"caf\xe9", "after"]))
  documents = records.encode(settings.records("train", "", 0, 1, None)[0],
                             settings, records.Skipped())
  with pytest.raises(tf.errors.InvalidArgumentError) as raw:
    _texts(documents)
  want = ("mem.txt, line 2: the text is not valid UTF-8 (set "
          "config.data.skip_bad_records=True to skip bad records).")
  # Without named_bad_records: the mark, the message's key, the message.
  assert re.search(r"<<bad record>>[0-9]+<<bad record>> " + re.escape(want),
                   raw.value.message)
  with pytest.raises(records.BadRecordError) as error:
    with records.named_bad_records():
      _texts(documents)
  assert str(error.value) == want
  assert error.value.__cause__ is None and error.value.__suppress_context__


def test_the_encoder_returns_ids_lengths_and_an_error_message():
  settings = _Listed()
  encoder = records._Encoder(settings, records.Skipped())
  sources = tf.constant([b"s", b"caf\xe9.txt", b"s"])
  flat, lengths, error = encoder(
      sources, tf.constant([1, 9, 3], tf.int64),
      tf.constant([b"ab", "é".encode(), b""]), tf.constant([True] * 3))
  assert flat.dtype == np.int32 and lengths.dtype == np.int32
  assert flat.tolist() == [97, 98, 0xc3, 0xa9]
  assert lengths.tolist() == [2, 2, 0]
  assert error == ""
  flat, lengths, error = encoder(
      sources, tf.constant([1, 9, 3], tf.int64),
      tf.constant([b"ab", b"x", b"y"]), tf.constant([True, False, True]))
  assert flat.tolist() == [] and lengths.tolist() == []
  match = re.fullmatch("<<bad record>>([0-9]+)<<bad record>> (.*)", error)
  message = ("caf\ufffd.txt, line 9: no text field 'text' (set "
             "config.data.skip_bad_records=True to skip bad records).")
  assert match and match.group(2) == message
  assert records._messages[int(match.group(1))] == message


def test_bad_records_are_counted_with_their_place_or_dropped(warnings):
  # A lone surrogate (as JSON escapes can give) is not UTF-8 either.
  settings = _Escaped(lines=_lines(["one", b"caf\xe9", "three", "four",
                                    "five", "six"]),
                      missing=(3, 5), skip_bad_records=True)
  raw = settings.records("train", "", 0, 1, None)[0]
  skipped = records.Skipped()
  assert _texts(records.encode(raw, settings, skipped)) == [
      "one", "three", "five"]
  assert skipped.counts() == {"not_utf8": 1, "missing_field": 2}
  assert warnings == [
      "Skipping a bad record (not_utf8): mem.txt, line 2: the text is not "
      "valid UTF-8 ('utf-8' codec can't encode character '\\udce9' in "
      "position 3: surrogates not allowed).",
      "Skipping a bad record (missing_field): mem.txt, line 4: no text "
      "field 'text'.",
      "Skipping a bad record (missing_field): mem.txt, line 6: no text "
      "field 'text'."]
  # A look-ahead (no counter) drops them without counting or raising,
  # with or without skip_bad_records.
  warnings.clear()
  for s in (settings, dataclasses.replace(settings,
                                          skip_bad_records=False)):
    assert _texts(records.encode(raw, s, None)) == ["one", "three", "five"]
  assert not warnings


def test_a_batch_of_only_bad_records_gives_no_document():
  settings = _Listed(lines=(b"\xff",) * 3 + (b"ok",),
                     skip_bad_records=True)
  skipped = records.Skipped()
  batch = records.encode(settings.records("", "", 0, 1, None)[0].take(3),
                         settings, skipped)
  assert _texts(batch) == []
  assert skipped.counts() == {"not_utf8": 3}


def test_documents_are_in_order_across_encode_batches():
  texts = [f"document {i}" + "x" * (i % 7) for i in range(200)]
  settings = _Listed(lines=_lines(texts))
  documents = records.encode(settings.records("", "", 0, 1, None)[0],
                             settings, records.Skipped())
  spec = documents.element_spec
  assert set(spec) == set(records.Settings.FEATURES) == {"tokens"}
  assert (spec["tokens"].dtype, spec["tokens"].shape) == (tf.int32, [None])
  assert _texts(documents) == texts


def test_a_slow_batch_keeps_its_place():

  class _Slow(_Listed):
    def text(self, record):
      if record == b"slow":
        time.sleep(0.5)
      return super().text(record)

  texts = ["slow"] + [f"document {i}" for i in range(200)]
  settings = _Slow(lines=_lines(texts))
  documents = records.encode(settings.records("", "", 0, 1, None)[0],
                             settings, records.Skipped())
  assert _texts(documents) == texts


def test_record_has_the_documented_types():
  r = records.record("a.jsonl", 7, b"{}")
  assert {k: v.dtype for k, v in r.items()} == {
      "source": tf.string, "index": tf.int64, "record": tf.string,
      "present": tf.bool}
  assert (r["source"].numpy(), int(r["index"]), r["record"].numpy(),
          bool(r["present"])) == (b"a.jsonl", 7, b"{}", True)
  assert not bool(records.record("a", 1, b"", False)["present"])


# A tokenizer in the pipeline.


def test_a_released_tokenizer_and_a_bpe_give_their_ids(tmp_path):
  texts = [f"the {i}th document, in a small corpus" for i in range(30)]
  hf = helpers.write_hf_tokenizer(str(tmp_path / "hf" / "tokenizer.json"),
                                  texts)
  bpe = str(tmp_path / "bpe.json")
  tokenizer_lib.write(tokenizer_lib.train(texts, 300), bpe)
  for settings, path in [
      (_Listed(lines=_lines(texts), tokenizer=f"hf:{hf}"), hf),
      (_Listed(lines=_lines(texts), tokenizer="bpe", bpe_vocab_size=300,
               tokenizer_path=bpe), bpe)]:
    documents = records.encode(settings.records("", "", 0, 1, None)[0],
                               settings, records.Skipped())
    tok = tokenizer_lib.load_hf(path)
    want = [e.ids for e in tok.encode_batch(texts)]
    assert _tokens(documents) == want
    assert max(map(max, want)) >= 256       # Merged tokens, not bytes.
    # The released tokenizer's template puts <s> (0) first; the BPE none.
    assert [w[0] == 0 for w in want] == [path == hf] * len(texts)


def test_tokenize_files_uses_the_released_tokenizer_and_skips_non_utf8(
    tmp_path, warnings):
  texts = ["a first file\n", "ünïcode text", "a third file"]
  hf = helpers.write_hf_tokenizer(str(tmp_path / "tokenizer.json"), texts)
  contents = [texts[0].encode(), texts[1].encode() + b"\xff", b"",
              texts[2].encode()]
  files = tf.data.Dataset.from_generator(
      lambda: ({"tokens": np.frombuffer(c, np.uint8),
                "path": f"/d/f{i}.txt".encode()}
               for i, c in enumerate(contents)),
      output_signature={"tokens": tf.TensorSpec([None], tf.uint8),
                        "path": tf.TensorSpec([], tf.string)})
  documents = records.tokenize_files(files, f"hf:{hf}")
  tok = tokenizer_lib.load_hf(hf)
  assert _tokens(documents) == [tok.encode(t).ids
                                for t in (texts[0], "", texts[2])]
  assert warnings == ["Skipping a bad record (not_utf8): /d/f1.txt, file 0: "
                      "the text is not valid UTF-8."]


# Settings.


def test_settings_checks_and_defaults():
  with pytest.raises(ValueError, match="text_field must name the field"):
    records.Settings(text_field="")
  with pytest.raises(ValueError, match="validation_percent"):
    records.Settings(validation_percent=0)
  settings = records.Settings()
  assert settings.tokenizes_in_pipeline is True
  assert settings.text(b"t\xc3\xa9") == "té"
  info = records.DocumentsInfo(mean_length=3.5, skipped=records.Skipped())
  assert settings.mean_length(info, "train") == 3.5
  with pytest.raises(dataclasses.FrozenInstanceError):
    info.mean_length = 1.0
  counter = records.Skipped()
  assert settings.skipped(counter) is None
  assert records.Settings(skip_bad_records=True).skipped(counter) is counter
  with pytest.raises(NotImplementedError):
    settings.records("train", "", 0, 1, counter)
  assert settings.resolve("/data") is settings      # Bytes: nothing to do.


_HELD = [f"record number {i}" for i in range(400)]


def test_the_hold_out_splits_by_hash_and_processes_share_records():
  buckets = _hash_buckets(_lines(_HELD))
  assert 20 in buckets                      # A record on the bound.
  settings = _Listed(lines=_lines(_HELD), hold_out=True,
                     validation_percent=20)
  split = {s: _split_texts(settings, s, 0, 1)
           for s in ("train", "validation")}
  assert split["validation"] == [t for t, b in zip(_HELD, buckets,
                                                   strict=True) if b < 20]
  assert split["train"] == [t for t, b in zip(_HELD, buckets, strict=True)
                            if b >= 20]
  assert [_split_texts(settings, "train", i, 3) for i in range(3)] == [
      split["train"][i::3] for i in range(3)]
  # No hold-out: every record in both splits; sharded: already this
  # process's own.
  for s in ("train", "validation"):
    assert _split_texts(_Listed(lines=_lines(_HELD)), s, 1, 2) == _HELD[1::2]
    assert _split_texts(_Listed(lines=_lines(_HELD), sharded=True), s, 1,
                        2) == _HELD


def test_documents_and_the_mean_length_of_the_first_records(warnings):
  texts = ["x" * (1 + i % 5) for i in range(256)] + ["y" * 500] * 30
  lines = _lines(texts[:10]) + (b"\xff",) + _lines(texts[10:])
  settings = _Listed(lines=lines, skip_bad_records=True)
  documents, info = settings.documents("train", data_dir="", process_index=0,
                                       process_count=1)
  # The bad record is dropped from the sample, not counted twice.
  sample = [len(t) for t in texts[:255]]
  assert info.mean_length == np.mean(sample)     # The same sum: exact.
  assert info.skipped.counts() == {}
  assert _texts(documents) == texts
  assert info.skipped.counts() == {"not_utf8": 1}
  # Documents with no tokens: the mean is at least 1.
  empty = _Listed(lines=(b"",) * 3)
  _, info = empty.documents("train", data_dir="", process_index=0,
                            process_count=1)
  assert info.mean_length == 1.0
  assert warnings == ["Skipping a bad record (not_utf8): mem.txt, line 11: "
                      "the text is not valid UTF-8."]


def test_a_split_without_documents(warnings):
  settings = _Listed(lines=(b"\xff", b"\xfe"), skip_bad_records=True)
  with pytest.raises(ValueError) as error:
    settings.documents(_name("train"), data_dir="", process_index=1,
                       process_count=2)
  assert str(error.value) == (
      "The training split of this data_records_test corpus has no document "
      "among its first 256 records for process 1 of 2: check "
      "config.data.text_field and the files (and "
      "config.data.validation_percent).")
  documents, info = settings.documents(_name("validation"), data_dir="",
                                       process_index=1, process_count=2)
  assert info.mean_length == 512.0
  assert warnings == [
      "The validation split of this data_records_test corpus has no "
      "document among its first 256 records for process 1 of 2 (a small "
      "corpus? config.data.validation_percent, validation_files)."]
  assert _texts(documents) == []
  with pytest.raises(TypeError):    # All but the split only by name.
    settings.documents("validation", "", 1, 2)


# The BPE built from the training records.


def test_training_texts_stop_at_the_byte_budget_and_skip_bad_records():
  texts = ["aé", b"\xff", "", "bbb", "cc", "dddd"]
  settings = _Listed(lines=_lines(texts), missing=(4,))
  # "aé" is 3 bytes (2 characters): 3 + 3 reaches 6, nothing more.
  assert settings._training_texts("", 6) == ["aé", "bbb"]
  assert settings._training_texts("", 5) == ["aé", "bbb"]     # Past it.
  assert settings._training_texts("", 7) == ["aé", "bbb", "dddd"]
  assert settings._training_texts("", 0) == []

  # A lone surrogate counts as one byte ("?").
  odd = _Escaped(lines=(b"\xff", b"abc"))
  assert odd._training_texts("", 1) == ["\udcff"]
  assert odd._training_texts("", 2) == ["\udcff", "abc"]


def test_training_texts_read_no_record_past_the_byte_budget():

  def unreadable(r):
    with tf.control_dependencies([tf.debugging.Assert(False, ["unread"])]):
      return {k: tf.identity(v) for k, v in r.items()}

  class _Broken(_Listed):
    """The lines, then records that cannot be read."""

    def records(self, *args):
      lines, hold_out, sharded = super().records(*args)
      return lines.concatenate(lines.map(unreadable)), hold_out, sharded

  settings = _Broken(lines=_lines(["abc", "def"] + ["more"] * 100))
  assert settings._training_texts("", 6) == ["abc", "def"]
  with pytest.raises(tf.errors.InvalidArgumentError):
    settings._training_texts("", 1000)


def test_the_bpe_path_is_named_by_the_settings_that_choose_the_texts():
  base = records.FilesSettings(files="/c/*.jsonl", tokenizer="bpe",
                               bpe_vocab_size=300)
  path = base.default_tokenizer_path("/data")
  assert re.fullmatch(
      r"/data/tokenizers/records_[0-9a-f]{16}_bpe300/tokenizer\.json", path)
  fields = {k: v for k, v in dataclasses.asdict(base).items()
            if k not in ("tokenizer", "bpe_vocab_size", "tokenizer_path",
                         "tokenizer_sha256", "skip_bad_records")}
  key = hashlib.sha256(repr(sorted(fields.items())).encode()).hexdigest()
  assert path == f"/data/tokenizers/records_{key[:16]}_bpe300/tokenizer.json"
  same = [dataclasses.replace(base, tokenizer_path="/t.json",
                              tokenizer_sha256="0" * 64,
                              skip_bad_records=True),
          dataclasses.replace(base, tokenizer="bytes")]
  assert {s.default_tokenizer_path("/data") for s in same} == {path}
  assert dataclasses.replace(base, bpe_vocab_size=400).default_tokenizer_path(
      "/data") == path.replace("_bpe300", "_bpe400")
  other = [dataclasses.replace(base, files="/d/*.jsonl"),
           dataclasses.replace(base, validation_percent=6),
           dataclasses.replace(base, text_field="body")]
  assert len({s.default_tokenizer_path("/data") for s in other} | {path}) == 4
  # The last part of the module's name ("data_records_test" has one).
  assert _Listed(tokenizer="bpe", bpe_vocab_size=300).default_tokenizer_path(
      "/data").startswith("/data/tokenizers/data_records_test_")


def test_resolve_builds_the_bpe_once_from_the_training_records(
    tmp_path, monkeypatch):
  texts = [f"a training text {i} for the merges" for i in range(60)]
  settings = _Listed(lines=_lines(texts), hold_out=True, tokenizer="bpe",
                     bpe_vocab_size=300, validation_percent=30)
  buckets = _hash_buckets(_lines(texts))
  train = [t for t, b in zip(texts, buckets, strict=True) if b >= 30]
  assert len(train) < len(texts)
  learnt = []
  real_train = tokenizer_lib.train
  monkeypatch.setattr(tokenizer_lib, "train", lambda t, v: (
      learnt.append((list(t), v)), real_train(t, v))[1])
  resolved = settings.resolve(str(tmp_path))
  path = settings.default_tokenizer_path(str(tmp_path))
  assert learnt == [(train, 300)]
  assert resolved == dataclasses.replace(
      settings, tokenizer_path=path,
      tokenizer_sha256=tokenizer_lib.sha256(path))
  # Built once: the file is reused, by default or named.
  assert settings.resolve(str(tmp_path)) == resolved
  named = dataclasses.replace(settings, tokenizer_path=path)
  assert named.resolve("/elsewhere") == resolved
  assert len(learnt) == 1
  # A named file is never built; `~` is the home folder.
  monkeypatch.setenv("HOME", str(tmp_path))
  with pytest.raises(FileNotFoundError,
                     match=re.escape(str(tmp_path / "none.json"))):
    dataclasses.replace(settings, tokenizer_path="~/none.json").resolve(
        str(tmp_path / "other"))
  os.rename(path, tmp_path / "moved.json")
  moved = dataclasses.replace(settings, tokenizer_path="~/moved.json")
  assert moved.resolve("/x").tokenizer_path == str(tmp_path / "moved.json")
  assert len(learnt) == 1
  with pytest.raises(text_files.TokenizerChangedError):
    dataclasses.replace(moved, tokenizer_sha256="0" * 64).resolve("/x")


def test_resolve_fills_in_a_released_tokenizers_checksum(tmp_path):
  hf = helpers.write_hf_tokenizer(str(tmp_path / "tokenizer.json"),
                                  ["some text", "more text"])
  settings = _Listed(tokenizer=f"hf:{hf}")
  resolved = settings.resolve(str(tmp_path / "data"))
  assert resolved == dataclasses.replace(
      settings, tokenizer_sha256=tokenizer_lib.sha256(hf))
  assert not os.path.exists(tmp_path / "data")
  with pytest.raises(text_files.TokenizerChangedError):
    dataclasses.replace(settings, tokenizer_sha256="0" * 64).resolve("/x")


# Files.


def _interleaved(sizes, cycle, block):
  """tf.data's deterministic interleave order of items of `sizes`: (item,
  element) pairs. A slot opens the next item when it is empty and finds an
  item's end only when it reads past it (a turn lost after a full block)."""
  todo, slots, out = list(range(len(sizes))), [None] * cycle, []
  while todo or any(slots):
    for k in range(cycle):
      if slots[k] is None and todo:
        slots[k] = [todo.pop(0), 0]
      for _ in range(block):
        if slots[k] is None:
          break
        item, done = slots[k]
        if done == sizes[item]:
          slots[k] = None
          break
        out.append((item, done))
        slots[k][1] += 1
  return out


def test_interleave_reads_eight_items_at_once_in_blocks_of_sixteen():
  sizes = [40, 3, 17, 33, 16, 0, 50, 20, 5, 60, 18, 2]
  items = tf.data.Dataset.from_tensor_slices(
      (tf.range(len(sizes)), tf.constant(sizes)))
  read = lambda item, size: tf.data.Dataset.range(
      tf.cast(size, tf.int64)).map(lambda j: (item, tf.cast(j, tf.int32)))
  got = [(int(i), int(j)) for i, j in records.interleave(
      items, read, len(sizes)).as_numpy_iterator()]
  assert got == _interleaved(sizes, 8, 16)
  assert got != _interleaved(sizes, 9, 16)
  few = items.take(3)
  assert [(int(i), int(j)) for i, j in records.interleave(
      few, read, 3).as_numpy_iterator()] == _interleaved(sizes[:3], 3, 16)
  assert list(records.interleave(few.take(0), read, 0)) == []


def test_interleave_keeps_its_order_when_an_item_is_slow():

  def late(item, j):
    if int(item) == 0 and int(j) == 0:
      time.sleep(0.5)
    return j

  read = lambda item: tf.data.Dataset.range(20).map(lambda j: (
      item, tf.ensure_shape(tf.py_function(late, [item, j], tf.int64), [])))
  got = [(int(i), int(j)) for i, j in records.interleave(
      tf.data.Dataset.range(3), read, 3).as_numpy_iterator()]
  assert got == _interleaved([20, 20, 20], 3, 16)


def _touch(root, *names):
  for name in names:
    path = root / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("x")


def test_match_files_in_glob_order_without_repeats_or_folders(
    tmp_path, monkeypatch):
  _touch(tmp_path, "b.jsonl", "a.jsonl", "c.txt", "d/e.jsonl",
         "home/h.jsonl")
  (tmp_path / "f.jsonl").mkdir()
  monkeypatch.setenv("HOME", str(tmp_path / "home"))
  got = records.match_files(
      f" {tmp_path}/*.txt ,,{tmp_path}/*.jsonl,{tmp_path}/a.jsonl,"
      "~/*.jsonl,", "files", None)
  assert got == [str(tmp_path / n) for n in (
      "c.txt", "a.jsonl", "b.jsonl", "home/h.jsonl")]
  monkeypatch.chdir(tmp_path / "d")
  assert records.match_files("*.jsonl", "files", None) == [
      str(tmp_path / "d" / "e.jsonl")]
  # `**`: the folder and every folder below it.
  assert records.match_files(f"{tmp_path}/**/*.jsonl", "files", None) == [
      str(tmp_path / n) for n in ("a.jsonl", "b.jsonl", "d/e.jsonl",
                                  "home/h.jsonl")]


def test_match_files_refuses_no_globs_and_no_files(tmp_path, warnings):
  _touch(tmp_path, "a.jsonl")
  for globs in ("", " , "):
    with pytest.raises(ValueError) as error:
      records.match_files(globs, "validation_files", records.Skipped())
    assert str(error.value) == (
        "config.data.validation_files is empty: give the corpus's files, "
        "e.g. --config.data.validation_files='/corpus/*.jsonl'.")
  none = f"{tmp_path}/none/*.jsonl"
  for globs, end in [(none, "path."), (f"{none},{none}x", "paths.")]:
    with pytest.raises(ValueError) as error:
      records.match_files(globs, "files", records.Skipped())
    assert str(error.value) == (
        f"config.data.files={globs!r} matches no file: check the {end}")
  globs = f"{none},{tmp_path}/*.jsonl"
  with pytest.raises(records.BadRecordError) as error:
    records.match_files(globs, "files", None)
  assert str(error.value).startswith(
      f"config.data.files: the glob {none!r} matches no file (set ")
  skipped = records.Skipped()
  for _ in range(2):
    assert records.match_files(globs, "files", skipped) == [
        str(tmp_path / "a.jsonl")]
  assert skipped.counts() == {"glob_matches_nothing": 1}
  assert warnings == [
      "Skipping a bad record (glob_matches_nothing): config.data.files: the "
      f"glob {none!r} matches no file."]
  # Each glob that matches nothing is counted (and named) once.
  warnings.clear()
  assert records.match_files(f"{globs},{none}x", "files", skipped) == [
      str(tmp_path / "a.jsonl")]
  assert skipped.counts() == {"glob_matches_nothing": 2}
  assert warnings == [
      "Skipping a bad record (glob_matches_nothing): config.data.files: the "
      f"glob {none + 'x'!r} matches no file."]


def test_split_files_of_each_split(tmp_path):
  _touch(tmp_path, "t.jsonl", "v.jsonl")
  train, valid = str(tmp_path / "t.jsonl"), str(tmp_path / "v.jsonl")
  none = str(tmp_path / "none.jsonl")
  held = records.FilesSettings(files=f"{train},{none}",
                               skip_bad_records=True)
  named = dataclasses.replace(held, validation_files=f"{valid},{none}x")
  skipped = records.Skipped()
  assert held.split_files("train", skipped) == ([train], True)
  assert held.split_files("validation", skipped) == ([train], True)
  assert named.split_files("train", skipped) == ([train], False)
  assert named.split_files(_name("validation"), skipped) == ([valid], False)
  assert skipped.counts() == {"glob_matches_nothing": 2}
  strict = dataclasses.replace(named, skip_bad_records=False)
  with pytest.raises(records.BadRecordError,
                     match=r"^config\.data\.validation_files: the glob"):
    strict.split_files("validation", records.Skipped())
  with pytest.raises(records.BadRecordError, match=r"^config\.data\.files:"):
    strict.split_files("train", records.Skipped())
