"""DDP communication hooks: fp16/bf16 gradient compression and PowerSGD, recorded in the plan
(registered by the apply_plan stage)."""
