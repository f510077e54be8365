r"""The accelerator runtime's start and host transfers, by pinned buffer.

Each setting runs in a fresh process (the runtime starts once per
process), settings alternating `--rounds` times: the seconds `jax.devices()`
takes after `import jax`, then the fastest of 3 `jax.device_put` and
`np.asarray` of a 16 MiB and a 1 GiB float32 array, each copy checked
exact. A setting is a size in MiB for libtpu's pinned transfer buffer
(`TPU_PREMAPPED_BUFFER_SIZE`, as `config.mesh.tpu_premapped_buffer_mib`
sets it; 0 = libtpu's default, 4 GiB on a v5e). On other backends the
variable does nothing, and the rows show it.

  python -m experiments.bench_runtime_start                  # 0, 256, 64 MiB
  python -m experiments.bench_runtime_start --mib=0,256 --rounds=3
"""

import json
import os
import subprocess
import sys

from absl import app, flags

from kda_lm.parallel import distributed

_MIB = flags.DEFINE_list("mib", ["0", "256", "64"],
                         "Pinned buffer sizes in MiB (0: libtpu's default).")
_ROUNDS = flags.DEFINE_integer("rounds", 2, "Times each setting runs.")
_BIG_MIB = flags.DEFINE_integer("big_mib", 1024,
                                "MiB of the large transfer (the small: 16).")

# One measurement, in its own process: prints a JSON line.
_CHILD = r"""
import json, os, sys, time
import numpy as np
t = time.time()
import jax
t_import = time.time() - t
t = time.time()
device = jax.devices()[0]
t_devices = time.time() - t
row = {"import_s": t_import, "devices_s": t_devices,
       "platform": device.platform,
       "buffer_env": os.environ.get(sys.argv[2])}
big_mib = int(sys.argv[1])
x = np.random.default_rng(0).standard_normal((big_mib // 4, 1 << 20),
                                             np.float32)
for name, array in (("small", x[:4]), ("big", x)):
  puts, gets = [], []
  for _ in range(3):
    t = time.time()
    y = jax.device_put(array, device).block_until_ready()
    puts.append(time.time() - t)
    t = time.time()
    back = np.asarray(y)
    gets.append(time.time() - t)
    assert np.array_equal(back, array), name
    del y
  row[name] = [min(puts), min(gets), array.nbytes]
print(json.dumps(row))
"""


def measure(mib: int, big_mib: int = 1024) -> dict:
  """One fresh process with a `mib` MiB buffer (0: libtpu's default),
  moving 16 MiB ("small") and `big_mib` MiB ("big")."""
  env = dict(os.environ)
  env.pop(distributed.PREMAPPED_SIZE_ENV, None)
  if mib:
    env[distributed.PREMAPPED_SIZE_ENV] = str(mib << 20)
  out = subprocess.run([sys.executable, "-c", _CHILD, str(big_mib),
                        distributed.PREMAPPED_SIZE_ENV],
                       env=env, check=True, capture_output=True,
                       text=True).stdout
  return json.loads(out.strip().splitlines()[-1])


def fmt(mib: int, row: dict) -> str:
  cells = [f"{mib} MiB" if mib else "default", row["platform"],
           f"{row['devices_s']:.2f}"]
  for name in ("small", "big"):
    put, get, nbytes = row[name]
    cells.append(f"{put * 1e3:,.0f} / {get * 1e3:,.0f} ms "
                 f"({nbytes / put / 1e9:.1f} / {nbytes / get / 1e9:.1f} GB/s)")
  return "| " + " | ".join(cells) + " |"


def main(argv):
  del argv
  sizes = [int(m) for m in _MIB.value]
  print("| buffer | platform | runtime start s | 16 MiB to / from | "
        f"{_BIG_MIB.value} MiB to / from |")
  print("| --- | --- | --- | --- | --- |")
  for _ in range(_ROUNDS.value):
    for mib in sizes:
      print(fmt(mib, measure(mib, _BIG_MIB.value)), flush=True)


if __name__ == "__main__":
  app.run(main)
