"""The compiler driver: `compile_for` (target -> pipeline -> CompiledModule) and the
`CompiledModule` it returns, with its report, history and runtime.

Layer: above report, bigmodel, runtime and passes (it runs the pipeline, which ends in the
appliers); below compat, launch and cli.
"""
