"""Run at the pre-move commit c964299 (PYTHONPATH=<that checkout>/src): GRPO runs (synchronous and async
k=1, LoRA) on the tiny model, stopped after step 2 with their checkpoint, for tests/test_old_checkpoints.py."""
import json, sys
from pathlib import Path
import torch
torch.set_num_threads(1)
from rlft.api import train
from rlft.models.tiny import build_tiny_model


def main() -> None:
    root = Path(sys.argv[1])
    root.mkdir(parents=True, exist_ok=True)
    build_tiny_model(root / "model", seed=0)
    (root / "reward.py").write_text("def digits(prompt, completion, **row):\n"
                                    "    return sum(ch.isdigit() for ch in completion) / max(len(completion), 1)\n")
    with (root / "prompts.jsonl").open("w") as f:
        for i in range(12):
            f.write(json.dumps({"prompt": f"Count to {i}."}) + "\n")

    def cfg(name, k):
        return {"method": "grpo", "output_dir": str(root / name), "seed": 3,
                "model": {"path": str(root / "model")}, "data": {"train": str(root / "prompts.jsonl")},
                "training": {"learning_rate": 1e-2, "max_steps": 5, "num_threads": 1, "precision": "fp32",
                             "lr_scheduler": "constant"},
                "rollout": {"group_size": 4, "prompts_per_step": 3, "max_new_tokens": 8, "async_steps": k,
                            "sampler": "thread"},
                "algorithm": {"epochs": 2, "minibatches": 2, "rollout_correction": "tis"},
                "rewards": [{"fn": f"{root / 'reward.py'}:digits"}],
                "lora": {"enabled": True, "r": 4, "alpha": 8, "dropout": 0.0},
                "checkpoint": {"every": 1, "keep_last": 1}, "logging": {"progress": False, "sample_every": 2}}

    for name, k in (("sync", 0), ("async-k1", 1)):
        c = cfg(name, k)
        (root / f"{name}.json").write_text(json.dumps(c))
        assert train(c, ["training.max_steps=2"])["status"] == "completed"
        full = cfg(name + "-full", k)
        assert train(full)["status"] == "completed"


if __name__ == "__main__":  # pytest's doctest collection imports this file: nothing may run then
    main()
