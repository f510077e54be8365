"""Every shape suffix in the package uses the letters of docs/glossary.md."""

import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Files that keep a library's own letters (docs/glossary.md, "Local
# letters inside the kernels").
LOCAL = ("kda_lm/ops/kda/", "kda_lm/ops/gmm.py")
SUFFIX = re.compile(r"\b[a-z][a-z0-9]*_([A-Z][A-Za-z0-9]*)\b")


def _glossary_letters():
  with open(os.path.join(ROOT, "docs", "glossary.md"), encoding="utf-8") as f:
    text = f.read()
  sizes = text.split("## Sizes")[1].split("\n## ")[0]
  return set(re.findall(r"^\| `(\w)` \|", sizes, flags=re.M))


def _shape_suffixes():
  """(path, name, suffix) of every shape-suffixed name in kda_lm/."""
  found = []
  for folder, _, names in os.walk(os.path.join(ROOT, "kda_lm")):
    for name in names:
      path = os.path.relpath(os.path.join(folder, name), ROOT)
      if not name.endswith(".py") or path.startswith(LOCAL):
        continue
      with open(os.path.join(ROOT, path), encoding="utf-8") as f:
        for match in SUFFIX.finditer(f.read()):
          suffix = match.group(1)
          # Shape suffixes are letters and digits (`_B1W`); constants and
          # CamelCase names (`_TMP_PATTERN`, `_Run`) are not shapes.
          if re.fullmatch(r"[A-Za-z1]+", suffix) and not re.search(
              r"[a-z]{2}", suffix) and len(suffix) <= 6:
            found.append((path, match.group(0), suffix))
  return found


def test_glossary_defines_the_letters_the_package_uses():
  letters = _glossary_letters()
  assert {"B", "T", "D", "H", "K", "V", "W", "M", "A", "E"} <= letters
  unknown = [(path, name) for path, name, suffix in _shape_suffixes()
             if any(c not in letters and c != "1" for c in suffix)]
  assert not unknown, (
      f"Shape names with letters not in docs/glossary.md: {unknown[:10]}")


def test_the_model_points_to_the_one_glossary():
  with open(os.path.join(ROOT, "kda_lm", "model.py"), encoding="utf-8") as f:
    text = f.read()
  assert "docs/glossary.md" in text
  assert "Shape glossary (" not in text
