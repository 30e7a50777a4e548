"""Tensor and expert parallel loading on 2 CPU ranks (gloo, torchrun): both families, TP and TP+EP, from
a checkpoint transformers' own class wrote, with the plans our classes ship (no overrides from the user).

Both ranks agree; the tokens equal a one-process run of ours and of transformers' class on each prompt
alone; the last logits are within 1e-5 of one process; the experts really are split across the ranks.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from helpers.qwen4 import make_pair as qwen_pair
from helpers.inkling import make_config as inkling_config
from helpers.inkling import make_pair as inkling_pair
from helpers.tp_worker import MODES, NEW, batch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.parametrize("family", ["qwen4_exp", "inkling"])
def test_tp_and_ep_on_two_ranks_equal_one_process(family, tmp_path):
    ref, ours = qwen_pair() if family == "qwen4_exp" else inkling_pair(inkling_config())
    ref.save_pretrained(tmp_path / "checkpoint")
    env = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="",
               PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           os.path.join(ROOT, "tests", "helpers", "tp_worker.py"), family, str(tmp_path / "checkpoint"), str(tmp_path)]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]

    prompts, ids, mask = batch(ours.config.vocab_size)
    ours.generation_config.eos_token_id = ref.generation_config.eos_token_id = None
    with torch.no_grad():
        logits = ours(ids, attention_mask=mask).logits[:, -1]
        tokens = ours.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False,
                               pad_token_id=0)[:, ids.shape[1]:].tolist()
        alone = [ref.generate(torch.tensor([p]), max_new_tokens=NEW, do_sample=False, pad_token_id=0)[0, len(p):]
                 .tolist() for p in prompts]
    assert tokens == alone
    for mode in MODES:
        assert ranks[0][mode] == ranks[1][mode], mode  # both ranks computed the same
        got = ranks[0][mode]
        assert got["tokens"] == tokens, mode
        torch.testing.assert_close(torch.tensor(got["logits"]), logits, rtol=1e-5, atol=1e-5, msg=mode)
        # The experts' packed gate/up weights are split over the two ranks (by expert under EP, by column
        # under TP), not copied whole.
        local, whole = got["experts_local"], got["experts_global"]
        assert torch.Size(local).numel() * 2 == torch.Size(whole).numel(), (mode, local, whole)
