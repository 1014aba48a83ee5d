"""`speclm draft distill`: fine-tune a draft model on the target's behaviour for a user's prompts
(DistillSpec's recipe: on-policy data, the target as teacher).

- speclm.distill.data: the prompts (a user's file, or speclm's own builder for one task kind), the
  evaluation overlap refused, and two data folders in the heads' format (speclm.heads.data): the
  target's greedy responses, and the draft's own samples; both carry the target's final hidden
  state at every token, from which the trainer computes the target's distribution (its output
  head) at every response position.
- speclm.distill.train: LoRA (peft) or full fine-tuning of the draft against those
  distributions (forward KL or total-variation distance), resumable, with held-out acceptance.
- speclm.models.adapters: the result loads as a draft anywhere (`--draft DIR`), the adapter
  merged at load.
"""
