"""Probe: self-certainty of right vs wrong sampled answers of a warm-started Intuitor policy, and per-token letter spread."""
import sys, torch
from lit_memopt import cli
ws, rate = sys.argv[1], sys.argv[2]
cfg = cli.compose_config(["recipe=intuitor", f"data.warm_start_guess_rate={rate}", "data.num_val=128", "logger.save_dir=/tmp/exp/probe"])
objects = cli.instantiate_run(cfg)
m, dm = objects.module, objects.datamodule
m.checker = dm.checker
m.model.load_state_dict(torch.load(ws, weights_only=True)); m.eval(); dm.setup("fit")
batch = next(iter(torch.utils.data.DataLoader(dm.val_set, batch_size=128, collate_fn=dm.val_dataloader().collate_fn)))
rollout, cert = m.sample_self_certainty(batch, num_samples=8, seed=7)
acc = m._accuracy(batch, rollout)
c, a = cert.view(128, 8), acc.view(128, 8)
mixed = (a.sum(1) > 0) & (a.sum(1) < 8)
diff = [(c[i][a[i] == 1].mean() - c[i][a[i] == 0].mean()).item() for i in range(128) if mixed[i]]
print(f"accuracy {a.mean():.3f}; mixed groups {int(mixed.sum())}; right minus wrong self-certainty mean {sum(diff)/len(diff):.3f}, "
      f"right higher in {sum(d > 0 for d in diff)} of {len(diff)}")
