"""policyscan train: a LoRA policy fitted on labeled conversations, on the prompt and the verdict `score` reads.

    data       labeled rows -> prompt ids through score's own encoder and prompt builder
    verdict    the differentiable model (transformers + PEFT) and f = logit(violation) - logit(compliant)
    fake_fp8   the base's linear layers swapped for FP8 scoring's numerics (--precision fp8)
    loop       length-bucketed batches, AdamW with warm-up and decay, early stopping on holdout loss
    bundle     the adapter written, checked against score, calibrated and committed into the policy folder"""
