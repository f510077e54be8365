"""The input pipeline: documents in, packed `[B,T]` rows out.

* `delayed_copy`, `text_files`: TFDS builders generated offline
  (`builders`: what they share).
* `records` and its sources `jsonl`, `parquet`, `tfds_source`: a corpus
  read where it lies, tokenized in the pipeline; `corpus`: what the
  pipeline reads of every dataset's settings.
* `tokenizer`: bytes, the byte-level BPE, released `tokenizer.json`s.
* `packing`: documents into rows with segment ids and positions.
* `pipeline`: the typed `config.data`, shuffling, batching, checkpointable
  iterators.
* `sections`: the one reader of config sections into frozen dataclasses
  (the library's typed configs use it too).

May import: nothing from `kda_lm` (the library reads the data's settings,
never the other way round; `tests/architecture_test.py` checks it).
"""
