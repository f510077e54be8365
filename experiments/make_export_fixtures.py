r"""Writes the kda-lm exports that tests/hf_convert_test.py checks against
transformers: models as a run trained here has them, exported.

Two models of `configs/ling3_tiny.py`'s widths with the byte vocabulary
(256 ids) of a run trained from scratch, randomly initialised (seeded) and
exported with `kda_lm.hf.save_pretrained` (no source checkpoint, so null
token ids) and the run's tokenizer as an export writes it
(`hf.workdir.write_tokenizer`: the byte-level `tokenizer.json`):
`export_bytes_bailing_hybrid` (Ling's layers as ling3_tiny has them) and
`export_bytes_kimi_linear` (the same widths with Kimi's KDA gate, NoPE MLA
and no output gate); and `export_bpe_bailing_hybrid`, a BPE run's (a
320-token BPE learnt on `corpora.corpus_texts`, the model's vocabulary
320). Then the fixture script, in its own environment, loads each with
transformers (and `AutoTokenizer`) and records its logits and the ids of
a text:

  python -m experiments.make_export_fixtures            # the test venv
  py="$(bash experiments/hf_fixtures_env.sh)"
  "$py" -m experiments.make_hf_fixtures export_bytes_bailing_hybrid \
      export_bytes_kimi_linear export_bpe_bailing_hybrid

The import test then checks that kda-lm gives transformers' logits on what
kda-lm exported (and that transformers loaded it: the golden file exists).
"""

import os
import tempfile

import jax

from configs import ling3_tiny
from data import tokenizer as tokenizer_lib
from kda_lm import config as config_lib
from kda_lm import hf, model
from kda_lm.hf import workdir as hf_workdir
from kda_lm.train import state as state_lib
from testbed import corpora

OUT = os.path.join(os.path.dirname(__file__), "..", "tests", "testdata",
                   "hf")
# A smaller depth and width than ling3_tiny's, to keep the files small.
SHAPE = dict(vocab_size=256, attention_pattern="KKKM", d_model=32,
             num_heads=2, head_dim=16, kv_lora_rank=16, qk_nope_head_dim=8,
             qk_rope_head_dim=8, v_head_dim=16, mlp_hidden_dim=64,
             moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2,
             num_shared_experts=1, first_k_dense_replace=1, norm_eps=1e-6,
             mla_norm_eps=1e-6, kda_impl="xla")
KIMI = dict(kda_gate="kimi", use_nope=True, mla_output_gate=False)
BPE_VOCAB = 320   # A BPE run's vocabulary (its tokenizer learnt on text).


def export(name, overrides, seed, tokenizer):
  m = ling3_tiny.model_config()
  m.update(dict(SHAPE, **overrides))
  cfg = config_lib.ModelConfig.from_config(m)
  params = model.build(cfg).init(jax.random.PRNGKey(seed),
                                 jax.numpy.zeros((1, 8), jax.numpy.int32))
  path = os.path.join(OUT, name)
  hf.save_pretrained(cfg, params, path)
  hf_workdir.write_tokenizer(tokenizer, path)
  print(f"{name}: written to {os.path.abspath(path)}")


def main():
  byte_level = state_lib.RunTokenizer("", released=False)
  export("export_bytes_bailing_hybrid", {}, 0, byte_level)
  export("export_bytes_kimi_linear", KIMI, 1, byte_level)
  with tempfile.TemporaryDirectory() as tmp:
    bpe = os.path.join(tmp, "tokenizer.json")
    tokenizer_lib.write(tokenizer_lib.train(corpora.corpus_texts(200),
                                            BPE_VOCAB), bpe)
    export("export_bpe_bailing_hybrid", {"vocab_size": BPE_VOCAB}, 2,
           state_lib.RunTokenizer(bpe, released=False))


if __name__ == "__main__":
  main()
