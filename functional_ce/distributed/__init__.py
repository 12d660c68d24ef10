"""``functional_ce`` on torch's distributed engine: the vocabulary-parallel forms of both losses
(:mod:`.vocab`, DTensor inputs sharded over the vocabulary), an FSDP2-sharded LM head with plain
hidden states (:mod:`.fsdp`), and the last pipeline stage's ``loss_fn`` (:mod:`.pipeline`).
The public loss functions hand DTensor inputs here; nothing needs importing by hand."""
