import sys, time, torch, lightning.pytorch as pl
sys.path.insert(0, "tests")
from test_intuitor import _config
from lit_memopt.data.reasoning_prompts import ReasoningPromptsDataModule
from lit_memopt.modules import IntuitorModule
from lit_memopt.modules.warm_start import WarmStart, fit_examples
steps, lr, hidden, seed, heads = int(sys.argv[1]), float(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
pl.seed_everything(seed)
config = _config()
config.arch.update(hidden_size=hidden, intermediate_size=2 * hidden, num_attention_heads=heads, num_key_value_heads=heads // 2)
tok = config.build_tokenizer()
data = ReasoningPromptsDataModule(tok, task="copy", min_word_length=2, max_word_length=3, num_val=64, batch_size=8, warm_start_guess_rate=0.4)
data.setup("fit")
m = IntuitorModule(config, tok, num_samples=8, max_new_tokens=4, checker=data.checker, accuracy_weight=1.0)
t = time.time()
fit_examples(m.model, tok, data.warm_start_examples, WarmStart(steps=steps, lr=lr, batch_size=32))
b = next(iter(torch.utils.data.DataLoader(data.val_set, batch_size=64, collate_fn=data.val_dataloader().collate_fn)))
m.eval()
with torch.no_grad():
    s = float(m._accuracy(b, m._rollout(b, 8, 1)).mean()); g = float(m._accuracy(b, m._rollout(b, 1, None, greedy=True)).mean())
print(steps, lr, hidden, seed, heads, f"sampled {s:.3f} greedy {g:.3f} in {time.time()-t:.1f}s")
