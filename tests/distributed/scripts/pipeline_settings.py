"""The runs of pipeline_runs.py (under torchrun) that test_pipeline.py repeats on one process."""

QUIET = dict(progress=False, tensorboard=False, log_every=1, device="cpu", optimizer="adam", lr=0.01)
SIMPLE = dict(QUIET, data="random", n_samples=1000, model="simplenet", epochs=1, max_steps=6, batch_size=64)

RUNS = {
    # 2 stages
    "two": {
        "simplenet": dict(SIMPLE, microbatches=4),
        # 250 samples in steps of 60: 4 full steps and one of 10 per epoch; micro-steps of 30
        # and 5 do not split into 4 pieces (3 of 10, 1 of 5); clipping by the global norm.
        "uneven": dict(QUIET, data="random", n_samples=250, model="simplenet", epochs=2, batch_size=60,
                       accumulate=2, microbatches=4, clip_grad=0.05),
        # tied embedding/head weights on different stages: [embedding, block 0] [block 1, head].
        # SGD, as in test_equivalence: TinyGPT has weights with gradients near 0, where Adam's
        # g/sqrt(v) turns a rounding difference of the gradient (1 process uses 2 threads, each
        # worker 1) into a visible step (up to 6e-5 of the weight scale after 1 step; SGD: 7e-9).
        "tinygpt": dict(QUIET, data="tokens", model="tinygpt", n_samples=160, seq_len=16, vocab_size=64,
                        epochs=1, max_steps=4, batch_size=32, microbatches=4, clip_grad=1.0,
                        optimizer="sgd", lr=0.1),
        # BatchNorm in one piece; SGD: a conv bias before BatchNorm has a gradient of ~0 (Adam again)
        "convnet": dict(QUIET, data="digits", model="convnet", epochs=1, max_steps=4, batch_size=32, microbatches=1,
                        optimizer="sgd", lr=0.1),
        # bf16 in one piece runs exactly one process's bf16 ops; in pieces, each piece's weight
        # gradient is rounded to bf16 on its own before they are added (SGD: Adam would magnify
        # the rounding where gradients are near 0, as for TinyGPT above).
        "bf16": dict(SIMPLE, microbatches=1, precision="bf16"),
        "bf16-pieces": dict(SIMPLE, microbatches=2, precision="bf16", optimizer="sgd", lr=0.1),
        # 1F1B on the uneven run: micro-steps of 30 run as 3 pieces, those of 5 as one piece under
        # GPipe (1F1B needs a piece per stage); the same computation in another order.
        "1f1b-uneven": dict(QUIET, data="random", n_samples=250, model="simplenet", epochs=2, batch_size=60,
                            accumulate=2, microbatches=4, clip_grad=0.05, pipeline_schedule="1f1b"),
        # Interleaved 1F1B: TinyGPT's 4 layers as 4 stages, rank 0 holding 0 and 2, rank 1 holding
        # 1 and 3; the tied embedding (stage 0) and head (stage 3) on different ranks.
        "interleaved": dict(QUIET, data="tokens", model="tinygpt", n_samples=160, seq_len=16, vocab_size=64,
                            epochs=1, max_steps=4, batch_size=32, microbatches=4, clip_grad=1.0,
                            optimizer="sgd", lr=0.1, pipeline_schedule="interleaved"),
        # fp16 in 2 pieces under 1F1B (one overflow check for all stages); SGD, as for bf16.
        "fp16": dict(SIMPLE, model="biggernet", microbatches=2, precision="fp16", optimizer="sgd", lr=0.1,
                     pipeline_schedule="1f1b"),
        # fp16 with clipping, in one piece (so that only clipping differs from one process): the
        # norm must be taken of the unscaled gradients (issue 53: the scaled ones were clipped, and
        # the run ended 6.6e-2 of the weight scale away); SGD with momentum, as the run.
        "fp16-clip": dict(SIMPLE, microbatches=1, precision="fp16", clip_grad=0.05, optimizer="sgd", lr=0.1),
        # Each stage writes its own part of the checkpoints (DCP); resumed as a pipeline below and on
        # one process by the test.
        "sharded-half": dict(SIMPLE, microbatches=4, max_steps=3, sharded_checkpoints=True),
        "sharded-on": dict(SIMPLE, microbatches=4, sharded_checkpoints=True, resume_from_run="sharded-half"),
        "first-half": dict(SIMPLE, microbatches=4, max_steps=3),   # resumed on one process by the test
        "from-single": dict(SIMPLE, microbatches=4, resume_from_argv=True),  # resumes a one-process checkpoint
    },
    # 3 stages: a middle stage that neither loads inputs nor computes the loss
    "three": {
        "biggernet": dict(SIMPLE, model="biggernet", microbatches=2),
    },
}
