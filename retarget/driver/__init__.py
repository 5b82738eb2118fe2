"""The compiler driver: `compile_for` (target -> pipeline -> plan applied) and the
`CompiledModule` it returns."""
