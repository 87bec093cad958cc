"""The runs of scripts/usermodel_runs.py (2 processes) and of their 1-process references."""
BASE = dict(epochs=2, max_steps=8, batch_size=32, optimizer="adam", lr=0.01, progress=False, tensorboard=False,
            log_every=1, device="cpu", checkpoints=False)

#: name -> settings; each trains on 2 processes and is compared with strategy single on one.
RUNS = {
    "unused-find": dict(model="usermodels:Unused", data="digits", strategy="ddp", find_unused_parameters=True),
    "unused-static": dict(model="usermodels:Unused", data="digits", strategy="ddp", static_graph=True),
    "unused-fsdp": dict(model="usermodels:Unused", data="digits", strategy="fsdp"),
    "frozen-ddp": dict(model="usermodels:Frozen", data="digits", strategy="ddp", accumulate=2),
    "frozen-fsdp": dict(model="usermodels:Frozen", data="digits", strategy="fsdp"),
    "frozen-allreduce": dict(model="usermodels:Frozen", data="digits", strategy="allreduce"),
    "frozen-pipeline": dict(model="usermodels:FrozenSeq", data="digits", strategy="pipeline"),
    "keywords-ddp": dict(model="usermodels:Keywords", data="usermodels:keyword_data", strategy="ddp", accumulate=2),
    "keywords-fsdp": dict(model="usermodels:Keywords", data="usermodels:keyword_data", strategy="fsdp"),
    "keyword-items-ddp": dict(model="usermodels:Keywords", data="usermodels:keyword_items", strategy="ddp"),
    "two-inputs-ddp": dict(model="usermodels:TwoInputs", data="usermodels:two_input_data", strategy="ddp"),
    # -100 padding (issue 29): TinyGPT with scaleloop's loss, the step weighted by its real targets
    # (without the count, 2 processes part from 1 by 1e-2 of the largest weight; SGD: see THIRD_PARTY below).
    "padded-allreduce": dict(model="tinygpt", data="usermodels:padded_tokens", strategy="allreduce", accumulate=2,
                             optimizer="sgd", lr=0.1),
    "padded-pipeline": dict(model="tinygpt", data="usermodels:padded_tokens", strategy="pipeline", accumulate=2,
                            microbatches=4, optimizer="sgd", lr=0.1),
    "regression-ddp": dict(model="usermodels:Regressor", data="usermodels:regression_data", strategy="ddp",
                           metrics="usermodels:abs_error", loss="usermodels:huber"),
}

#: Conditional computation (issue 28): parameters that some steps or ranks do not use. Each model
#: under every strategy that averages gradients, with SGD with momentum and with Adam, whose state
#: an unused parameter must leave untouched, as one process does (docs/strategies.md).
SGD = dict(optimizer="sgd", lr=0.1, momentum=0.9)
_SHAPES = {"aux": ("usermodels:AuxHead", "usermodels:AuxHeadSeq"),
           "expert": ("usermodels:RareExpert", "usermodels:RareExpertSeq")}
_WHERE = {"allreduce": dict(strategy="allreduce"), "fsdp": dict(strategy="fsdp"), "mesh-dp": dict(mesh="dp=2"),
          "mesh-fsdp": dict(mesh="fsdp=2"), "pipeline": dict(strategy="pipeline"),
          "ddp": dict(strategy="ddp", find_unused_parameters=True)}
CONDITIONAL = {
    f"{shape}-{where}-{opt}": dict(model=models[where == "pipeline"], data="digits", **settings,
                                   **(SGD if opt == "sgd" else {}),
                                   # accumulation too, where a micro-step may use what the other did not
                                   **(dict(accumulate=2) if opt == "sgd" and where in ("allreduce", "fsdp") else {}))
    for shape, models in _SHAPES.items() for where, settings in _WHERE.items() for opt in ("sgd", "adam")}

#: The same on 4 processes (scripts/mesh_runs.py, tests in test_mesh_dist.py): HSDP (replicated
#: over dp, sharded over fsdp) and pipeline x data parallel, whose replicas average a stage's gradients.
CONDITIONAL_4 = {
    f"{shape}-{where}-{opt}": dict(model=models[where == "pp-dp"], data="digits", mesh=mesh,
                                   **(SGD if opt == "sgd" else {}))
    for shape, models in _SHAPES.items() for where, mesh in (("hsdp", "dp=2,fsdp=2"), ("pp-dp", "pp=2,dp=2"))
    for opt in ("sgd", "adam")}

#: Third-party models train with SGD: Adam divides each gradient by its own running size, which
#: turns rounding noise in a gradient that is zero in exact arithmetic (an attention key's bias:
#: softmax ignores a shift) into full-size steps, so 2 ranks and 1 would part by lr per step.
THIRD_PARTY = dict(optimizer="sgd", lr=0.1)

#: Hugging Face transformers models (scripts/hfmodels.py): their own loss, keyword batches (the
#: pipeline's: (input_ids, next tokens) pairs and scaleloop's loss).
HF_RUNS = {
    "gpt2-ddp": dict(**THIRD_PARTY, model="hfmodels:gpt2_tiny", data="hfmodels:lm_data", strategy="ddp", accumulate=2),
    "gpt2-fsdp": dict(**THIRD_PARTY, model="hfmodels:gpt2_tiny", data="hfmodels:lm_data", strategy="fsdp"),
    # -100 padding (issue 29): the model's own loss, told num_items_in_batch, and scaleloop's loss.
    # (4 steps: without the count, 2 processes already part from 1 by 3e-4 (fsdp) to 1.6e-3 (ddp) of the
    # largest weight.)
    "gpt2-padded-ddp": dict(**THIRD_PARTY, model="hfmodels:gpt2_tiny", data="hfmodels:lm_data_padded",
                            strategy="ddp", accumulate=2, max_steps=4),
    "gpt2-padded-fsdp": dict(**THIRD_PARTY, model="hfmodels:gpt2_tiny", data="hfmodels:lm_data_padded",
                             strategy="fsdp", max_steps=4),
    "gpt2-pairs-padded-ddp": dict(**THIRD_PARTY, model="hfmodels:gpt2_tiny", data="hfmodels:lm_pairs_padded",
                                  strategy="ddp", accumulate=2, max_steps=4),
    # The blocks their _no_split_modules declare (strategies/blocks.py) as FSDP units and checkpointed.
    "llama-fsdp-ac": dict(**THIRD_PARTY, model="hfmodels:llama_tiny", data="hfmodels:lm_data", strategy="fsdp",
                          activation_checkpointing=True),
    "gpt2-fsdp-ac": dict(**THIRD_PARTY, model="hfmodels:gpt2_tiny", data="hfmodels:lm_data", strategy="fsdp",
                         activation_checkpointing=True),
    # Tensor parallelism by the model's own plan (transformers' tp_plan: strategies/tensor.py): the
    # attention and MLP Linears, the vocabulary-split embedding and the gathered output layer.
    "llama-tp": dict(**THIRD_PARTY, model="hfmodels:llama_tiny", data="hfmodels:lm_data", mesh="tp=2"),
    # The pipeline cuts the decoder LMs at their blocks (strategies/hf_stages.py): in pieces, with
    # GPT-2's and Qwen2's tied head summed over the end stages, and as --mesh pp=2.
    "llama-pipeline": dict(**THIRD_PARTY, model="hfmodels:llama_tiny", data="hfmodels:lm_pairs", strategy="pipeline",
                           microbatches=2),
    "gpt2-pipeline": dict(**THIRD_PARTY, model="hfmodels:gpt2_tiny", data="hfmodels:lm_pairs", strategy="pipeline"),
    "qwen2-mesh-pp": dict(**THIRD_PARTY, model="hfmodels:qwen2_tiny", data="hfmodels:lm_pairs", mesh="pp=2",
                          microbatches=2, pipeline_schedule="1f1b"),
    "bert-ddp": dict(**THIRD_PARTY, model="hfmodels:bert_tiny", data="hfmodels:classification_data", strategy="ddp"),
    "bert-fsdp": dict(**THIRD_PARTY, model="hfmodels:bert_tiny", data="hfmodels:classification_data", strategy="fsdp",
                      accumulate=2),
}

#: timm models (scripts/hfmodels.py), pretrained=False.
VISION_RUNS = {
    # The ResNet trains in float64 (see resnet_tiny in scripts/hfmodels.py).
    "resnet-ddp": dict(**THIRD_PARTY, model="hfmodels:resnet_tiny", data="hfmodels:image_data_f64", strategy="ddp",
                       sync_batchnorm=True),
    "resnet-fsdp": dict(**THIRD_PARTY, model="hfmodels:resnet_tiny", data="hfmodels:image_data_f64",
                        strategy="fsdp", sync_batchnorm=True),
    "vit-ddp": dict(**THIRD_PARTY, model="hfmodels:vit_tiny", data="hfmodels:image_data", strategy="ddp"),
    "vit-fsdp": dict(**THIRD_PARTY, model="hfmodels:vit_tiny", data="hfmodels:image_data", strategy="fsdp"),
}
