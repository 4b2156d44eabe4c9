"""A local lm-evaluation-harness task for the tests: no network, no harness datasets cache."""
from __future__ import annotations

import json
import random
from pathlib import Path

from tests.helpers.data import WORDS

TASK = "normlab_tiny_mc"


def write_task(root: Path) -> Path:
    """A multiple-choice task over 12 local items: which word continues a phrase of the tiny corpus."""
    rng = random.Random(0)
    items = []
    for _ in range(12):
        choices = rng.sample(WORDS, 4)
        items.append({"question": " ".join(rng.choice(WORDS) for _ in range(rng.randint(0, 6))),
                      "choices": [f" {c}" for c in choices], "answer": rng.randrange(4)})
    items[0]["question"] = ""  # an empty context: conditioned on BOS/EOS, as `hf` does
    (root / "items.jsonl").write_text("".join(json.dumps(item) + "\n" for item in items))
    (root / f"{TASK}.yaml").write_text(f"""task: {TASK}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {root / 'items.jsonl'}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
target_delimiter: ""
doc_to_choice: "{{{{choices}}}}"
doc_to_target: answer
metric_list:
  - metric: acc
""")
    return root
