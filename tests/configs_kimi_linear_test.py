"""configs/kimi_linear.py: the published Kimi-Linear-48B-A3B shapes."""

from configs import kimi_linear, ling3
from kda_lm import config
from kda_lm.hf import formats


def test_counts_near_the_published_48b_a3b():
  c = ling3.count_params(kimi_linear.model_config())
  # 49.1B by shape arithmetic against the name's "48B" (+2.3%); 3.1B
  # activated against "A3B".
  assert 48.5e9 < c["total"] < 49.5e9, c
  assert 3.0e9 < c["activated"] < 3.2e9, c


def test_layout_and_hugging_face_config_round_trip():
  m = kimi_linear.model_config()
  cfg = config.ModelConfig.from_config(m)
  mla = [i + 1 for i, c in enumerate(cfg.attention_pattern) if c == "M"]
  assert mla == [4, 8, 12, 16, 20, 24, 27]
  hf_config = formats.to_hf(cfg, "kimi_linear")
  assert hf_config["linear_attn_config"]["full_attn_layers"] == mla
  back = config.ModelConfig.from_config(formats.from_hf(hf_config))
  differ = {f: (getattr(back, f), getattr(cfg, f))
            for f in config.field_names(config.ModelConfig)
            if getattr(back, f) != getattr(cfg, f)}
  # Not in the format: how the model runs, not what it is.
  assert set(differ) == {"compute_dtype", "scan_layers"}, differ
