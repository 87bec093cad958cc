"""07 — a Hugging Face model in the same loop: keyword batches, and the model's own loss.

    python examples/07_huggingface.py [--out weights.pt]
    torchrun --nproc-per-node 2 examples/07_huggingface.py

The diff from 02_ddp.py: the model is a small GPT-2 built from a config (transformers is not a
dependency of scaleloop: `pip install transformers`; nothing is downloaded), the data is a
`DictTensorDataset` of input_ids, attention_mask and labels, so each batch is a mapping of the
model's inputs and the labels (its target), the model is called as `model(**x, labels=labels)`,
and the loss is the one the model computes. The strategy
is "ddp" under torchrun and "single" otherwise; with 2 processes the weights equal 1 process's.
"""
import argparse

import torch
from transformers import GPT2Config, GPT2LMHeadModel

import scaleloop as sl

parser = argparse.ArgumentParser()
parser.add_argument("--out", help="save the final weights here")
parser.add_argument("--steps", type=int, default=20)
args = parser.parse_args()

torch.manual_seed(0)
env = sl.DistEnv.from_env(device="cpu")
sl.init_process_group(env)

# Token sequences with a pattern to learn: every other token follows from the one before it.
ids = torch.randint(0, 64, (512, 16), generator=torch.Generator().manual_seed(0))
ids[:, 1::2] = (ids[:, ::2] + 1) % 64
dataset = sl.DictTensorDataset(input_ids=ids, attention_mask=torch.ones_like(ids), labels=ids)
# GPT-2's config names its own vocabulary's special tokens (50256) and the model no loss type:
# both said here, for this 64-token vocabulary, else transformers warns about each at start-up.
model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2,
                                   resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,  # no dropout: N ranks = 1
                                   bos_token_id=0, eos_token_id=0))
model.loss_type = "ForCausalLM"   # the token-mean cross-entropy over the shifted labels

strategy = sl.strategy("ddp" if env.is_distributed else "single", env)
model, optimizer = strategy.setup(model, lambda params: torch.optim.SGD(params, lr=0.5))
loader = strategy.loader(dataset, batch_size=64, shuffle=True, seed=0)   # global batch

step = 0
for epoch in range(100):
    loader.set_epoch(epoch)
    for batch in loader:
        x, labels = batch                     # x: {"input_ids", "attention_mask"}; labels: the "labels" entry
        with strategy.micro_step(model, batch):
            loss = model(**x, labels=labels).loss   # the model shifts the labels, averages per token
            strategy.backward(loss, batch)
        if batch.last_micro:
            strategy.optimizer_step(optimizer)
            step += 1
            if env.is_main and step % 5 == 0:
                print(f"step {step}: loss {loss.item():.4f}")
        if step == args.steps:
            break
    if step == args.steps:
        break

if env.is_main:
    print(f"rank 0/{env.world_size}: {step} steps, last loss {loss.item():.4f}")
    if args.out:
        torch.save(strategy.unwrap(model).state_dict(), args.out)
sl.destroy_process_group()
