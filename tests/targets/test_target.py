"""The target spec: grammar.py, its part table (schema.py), option values (options.py) and the
rules between parts (rules.py). Accelerate config files: test_accelerate_yaml.py."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from retarget.targets.grammar import (
    PARTS,
    STRATEGIES,
    Option,
    Part,
    Target,
    TargetError,
    parse_target,
)

# --- canonical form and round trips -------------------------------------------------------------

# Every part needs these to stand in a valid target.
COMPANION = {
    "offload": "fsdp",
    "powersgd": "ddp",
    "fp16-comm": "ddp",
    "bf16-comm": "ddp",
    "cp": "ddp",
}


@pytest.mark.parametrize("name", list(PARTS))
def test_every_part_alone_round_trips_with_defaults(name):
    spec = f"{COMPANION[name]}+{name}" if name in COMPANION else name
    target = parse_target(spec)
    assert str(target) == spec
    assert parse_target(str(target)) == target
    part = target.get(name)
    assert part.options == ()
    assert part.as_dict() == {key: opt.default for key, opt in PARTS[name].options.items()}


# Canonical specs that together set every option to a non-default value.
NON_DEFAULT = [
    "ddp[broadcast_buffers=false,bucket_cap_mb=50,find_unused_parameters=true,"
    "gradient_as_bucket_view=true,static_graph=true]",
    "fsdp[cpu_ram_efficient_loading=true,min_params=1000,reshard=false,state_dict=full,"
    "sync_module_states=false]",
    "zero1[broadcast_buffers=false,bucket_cap_mb=1,find_unused_parameters=true,"
    "gradient_as_bucket_view=true,static_graph=true]",
    "zero2[cpu_ram_efficient_loading=true,min_params=5,state_dict=full,sync_module_states=false]",
    "zero3[cpu_ram_efficient_loading=true,min_params=5,state_dict=full,sync_module_states=false]",
    "hsdp[cpu_ram_efficient_loading=true,min_params=5,replicate=2,reshard=false,shard=8,"
    "state_dict=full,sync_module_states=false]",
    "fsdp+tp[async_tp=true,loss_parallel=true,plan=pkg.plans:LLAMA_PLAN,sequence_parallel=true,size=4]",
    "tp[plan=hf]",
    "fsdp+cp[attention=ulysses,load_balance=false,size=2]",
    "pp[cuts=blocks,microbatches=4,schedule=gpipe,size=2,stages_per_rank=1]",
    "xla[spmd=false]+bf16[autocast_eval=false,downcast=true,keep_fp32=cumsum|exp]",
    "xla[sharding=replicate]",
    "fp16[autocast_eval=false,backoff_factor=0.25,growth_factor=4.0,growth_interval=100,"
    "init_scale=1024.0,keep_fp32=none]",
    "fp8[amax_algo=max,amax_history=1024,autocast_eval=true,backend=te,exclude=lm_head,"
    "format=e4m3,include=layers.*|mlp?,interval=2,margin=1,min_size=0,"
    "override_linear_precision=true|false|false]",
    "fp8[backend=msamp,opt_level=o1]",
    "fp8[backend=torchao,scaling=rowwise]",
    "fp8[scaling=current]",
    "quant[backend=native,block_size=128,compute=bf16,double_quant=true,skip=*.o_proj|mlp.*,"
    "type=fp4]",
    "quant[bits=8,type=int8]",
    "ac[every=2,policy=selective]",
    "ac[budget=0.5]",
    "fsdp+offload[optimizer=false,pin_memory=true]",
    "fsdp+offload[params=false]",
    "compile[backend=aot_eager,dynamic=false,fullgraph=true,mode=reduce-overhead,scope=whole]",
    "stream[from=cpu,max_memory=2GiB,prefetch=3]",
    "ddp+powersgd[error_feedback=false,min_compression_rate=1.5,rank=4,start_iter=0,"
    "warm_start=false,wrapper=bf16]",
]


@pytest.mark.parametrize("spec", NON_DEFAULT)
def test_non_default_options_round_trip(spec):
    target = parse_target(spec)
    assert str(target) == spec
    assert parse_target(str(target)) == target
    assert Target.from_dict({p.name: dict(p.options) for p in target.parts}) == target


def test_non_default_specs_cover_every_option_that_has_a_non_default():
    parts = [part for spec in NON_DEFAULT for part in parse_target(spec).parts]
    covered = {(part.name, key) for part in parts for key, _ in part.options}
    settable = {
        (name, key)
        for name, schema in PARTS.items()
        for key, opt in schema.options.items()
        if opt.choices != (opt.default,)
    }
    assert covered == settable


@pytest.mark.parametrize(
    ("spec", "canonical"),
    [
        (" BF16 + ddp[bucket_cap_mb=50] ", "ddp[bucket_cap_mb=50]+bf16"),
        ("fp8[AMAX_HISTORY=1024, Backend=TE]+fsdp", "fsdp+fp8[amax_history=1024,backend=te]"),
        ("bf16+ddp", "ddp+bf16"),
        ("ddp[bucket_cap_mb=25]", "ddp"),
        ("bf16[keep_fp32=norm|softmax|loss]", "bf16"),
        ("bf16[keep_fp32=pow|EXP]", "bf16[keep_fp32=exp|pow]"),
        ("bf16[keep_fp32=none]", "bf16[keep_fp32=none]"),
        ("fsdp[reshard=no]", "fsdp[reshard=false]"),
        ("fsdp[min_params=007]", "fsdp[min_params=7]"),
        ("fp16[init_scale=1024]", "fp16[init_scale=1024.0]"),
        ("fp16[init_scale=1e-3]", "fp16[init_scale=0.001]"),
        ("compile[mode=MAX-AUTOTUNE,backend=Inductor]", "compile[mode=max-autotune]"),
        ("ac[budget=2GB]", "ac[budget=2GB]"),
        ("ac[budget=2000MB]", "ac[budget=2GB]"),
        ("ac[budget=2048MiB]", "ac[budget=2GiB]"),
        ("ac[budget=1.5GiB]", "ac[budget=1536MiB]"),
        ("ac[budget=1000001B]", "ac[budget=1000001B]"),
        ("ac[budget=.25]", "ac[budget=0.25]"),
        ("ac[budget=1]", "ac[budget=1.0]"),
        ("ac[policy=budget,budget=0.5]", "ac[budget=0.5]"),
        ("fp8[backend=te,opt_level=o2]", "fp8[backend=te]"),
        ("tp", "tp"),
        ("fsdp+tp+ac+bf16", "fsdp+tp+bf16+ac"),
    ],
)
def test_canonical_strings(spec, canonical):
    assert str(parse_target(spec)) == canonical
    assert parse_target(canonical) == parse_target(spec)


def test_equal_targets_hash_equal():
    assert hash(parse_target("bf16+ddp")) == hash(parse_target("ddp + BF16"))
    assert parse_target("ddp[bucket_cap_mb=25]") == parse_target("ddp")
    assert parse_target("ddp") != parse_target("ddp+bf16")


def test_target_accessors():
    target = parse_target("bf16+fsdp[reshard=false]+ac[budget=8GiB]")
    assert target.names == ("fsdp", "bf16", "ac")
    assert target.strategy == "fsdp"
    assert target.has("FSDP") and "bf16" in target and "fp8" not in target
    assert target.get("fp8") is None
    assert target.get("fsdp") == Part("fsdp", {"reshard": False})
    assert target.get("ac").get("budget") == 8 * 2**30
    assert target.get("ac").get("policy") == "budget"  # implied by the budget
    assert target.get("fsdp").get("state_dict") == "sharded"
    assert repr(target) == "Target('fsdp[reshard=false]+bf16+ac[budget=8GiB]')"
    assert repr(target.get("fsdp")) == "Part('fsdp[reshard=false]')"
    assert parse_target(target) is target


def test_strategy_is_single_without_a_distribution_part():
    assert parse_target("bf16").strategy == "single"
    assert parse_target("single").strategy == "single"
    assert parse_target("tp").strategy == "single"
    assert {parse_target(name).strategy for name in STRATEGIES} == set(STRATEGIES)


def test_unknown_names_in_lookups_raise_key_error():
    target = parse_target("ddp")
    with pytest.raises(KeyError, match="did you mean 'fsdp'"):
        target.has("fsdpp")
    with pytest.raises(KeyError, match="did you mean 'reshard'"):
        Part("fsdp").get("reshrd")


def test_part_from_python_values_is_normalized():
    part = Part("FP8", {"backend": "TE", "amax_history": 1024, "include": ["b", "a"]})
    assert str(part) == "fp8[amax_history=1024,backend=te,include=a|b]"
    assert part.options == (("amax_history", 1024), ("backend", "te"), ("include", ("a", "b")))
    assert part.as_dict()["format"] == "hybrid"
    assert Part("ac", {"budget": 0.5}) == Part("ac", (("budget", "0.5"),))


@pytest.mark.parametrize(
    ("name", "options", "message"),
    [
        ("fsdp", {"reshard": 1}, "bad value '1' for option 'reshard' of 'fsdp': expected true or"),
        (
            "fsdp",
            {"min_params": 2.5},
            "bad value '2.5' for option 'min_params' of 'fsdp': expected",
        ),
        ("ac", {"budget": 10}, "a size budget must be at least 1MB"),
        ("fsdp", ("reshard",), "options of 'fsdp' must be (key, value) pairs, got 'reshard'"),
    ],
)
def test_part_from_bad_python_values(name, options, message):
    with pytest.raises(TargetError) as info:
        Part(name, options)
    assert message in str(info.value)


def test_empty_and_wrong_typed_targets():
    with pytest.raises(TargetError, match="empty target; write e.g."):
        Target(())
    with pytest.raises(TypeError, match="Target.parts must be Part objects"):
        Target(("ddp",))
    with pytest.raises(TypeError, match="a target spec must be a str, got int"):
        parse_target(3)


# --- errors -------------------------------------------------------------------------------------

ERRORS = [
    # unknown names, with suggestions
    ("fsdpp+bf16", "fsdpp", "unknown target part 'fsdpp' in 'fsdpp+bf16'; did you mean 'fsdp'?"),
    ("FSDPP", "fsdpp", "unknown target part 'fsdpp'; did you mean 'fsdp'?"),
    ("float8+ddp", "float8", "unknown target part 'float8' in 'float8+ddp'; did you mean 'fp8'?"),
    (
        "xyzzy",
        "xyzzy",
        "unknown target part 'xyzzy'; expected one of: single, ddp, fsdp, zero1, zero2, zero3, "
        "hsdp, tp, cp, pp, xla, bf16, fp16, fp8, quant, ac, offload, compile, powersgd, "
        "fp16-comm, bf16-comm, stream",
    ),
    # unknown options
    (
        "fsdp[reshrd=1]",
        "fsdp[reshrd=1]",
        "unknown option 'reshrd' for 'fsdp' in 'fsdp[reshrd=1]'; did you mean 'reshard'?",
    ),
    (
        "fsdp[zzz=1]",
        "fsdp[zzz=1]",
        "unknown option 'zzz' for 'fsdp' in 'fsdp[zzz=1]'; expected one of: reshard, min_params, "
        "cpu_ram_efficient_loading, state_dict, sync_module_states",
    ),
    (
        "single[x=1]",
        "single[x=1]",
        "unknown option 'x' for 'single' in 'single[x=1]'; 'single' takes no options",
    ),
    # bad values
    (
        "fp8[amax_history=x]",
        "fp8[amax_history=x]",
        "bad value 'x' for option 'amax_history' of 'fp8' in 'fp8[amax_history=x]': "
        "expected an integer",
    ),
    (
        "ddp[static_graph=maybe]",
        "ddp[static_graph=maybe]",
        "bad value 'maybe' for option 'static_graph' of 'ddp' in 'ddp[static_graph=maybe]': "
        "expected true or false",
    ),
    (
        "fp8[backend=tee]",
        "fp8[backend=tee]",
        "bad value 'tee' for option 'backend' of 'fp8' in 'fp8[backend=tee]': "
        "expected one of auto, native, torchao, te, msamp; did you mean 'te'?",
    ),
    (
        "bf16[keep_fp32=sofmax]",
        "bf16[keep_fp32=sofmax]",
        "bad value 'sofmax' for option 'keep_fp32' of 'bf16' in 'bf16[keep_fp32=sofmax]': "
        "expected one of softmax, norm, loss, exp, log, pow, reduce, cumsum; "
        "did you mean 'softmax'?",
    ),
    (
        "fp8[amax_history=0]",
        "fp8[amax_history=0]",
        "bad value '0' for option 'amax_history' of 'fp8' in 'fp8[amax_history=0]': must be >= 1",
    ),
    (
        "fsdp[min_params=-1]",
        "fsdp[min_params=-1]",
        "bad value '-1' for option 'min_params' of 'fsdp' in 'fsdp[min_params=-1]': must be >= 0",
    ),
    (
        "fp16[backoff_factor=1]",
        "fp16[backoff_factor=1]",
        "bad value '1' for option 'backoff_factor' of 'fp16' in 'fp16[backoff_factor=1]': "
        "must be < 1",
    ),
    (
        "fp16[init_scale=1e999]",
        "fp16[init_scale=1e999]",
        "bad value '1e999' for option 'init_scale' of 'fp16' in 'fp16[init_scale=1e999]': "
        "expected a finite number",
    ),
    (
        "fp8[override_linear_precision=true|true]",
        "fp8[override_linear_precision=true|true]",
        "bad value 'true|true' for option 'override_linear_precision' of 'fp8' in "
        "'fp8[override_linear_precision=true|true]': expected 3 bools joined by '|', "
        "e.g. false|false|true",
    ),
    (
        "fp8[include=a|a]",
        "fp8[include=a|a]",
        "bad value 'a|a' for option 'include' of 'fp8' in 'fp8[include=a|a]': 'a' is listed twice",
    ),
    (
        "fp8[include=x|none]",
        "fp8[include=x|none]",
        "bad value 'x|none' for option 'include' of 'fp8' in 'fp8[include=x|none]': "
        "'none' stands for the empty list and cannot be an item",
    ),
    (
        "ac[budget=2]",
        "ac[budget=2]",
        "bad value '2' for option 'budget' of 'ac' in 'ac[budget=2]': a fraction must be in "
        "(0, 1]; add a unit for a size, e.g. 8GiB",
    ),
    (
        "ac[budget=100KB]",
        "ac[budget=100KB]",
        "bad value '100KB' for option 'budget' of 'ac' in 'ac[budget=100KB]': a size budget "
        "must be at least 1MB; use a fraction for a share",
    ),
    (
        "ac[budget=1.0000001KB]",
        "ac[budget=1.0000001KB]",
        "bad value '1.0000001KB' for option 'budget' of 'ac' in 'ac[budget=1.0000001KB]': "
        "1.0000001KB is not a whole number of bytes",
    ),
    (
        "compile[backend=a b]",
        "compile[backend=a b]",
        "bad value 'a b' for option 'backend' of 'compile' in 'compile[backend=a b]': "
        "expected a name of letters, digits, '_', '.', ':' or '-'",
    ),
    # duplicates
    ("ddp+ddp", "ddp", "part 'ddp' appears twice in 'ddp+ddp'; write it once with all its options"),
    (
        "ddp[bucket_cap_mb=3]+DDP",
        "ddp",
        "part 'ddp' appears twice in 'ddp[bucket_cap_mb=3]+DDP'; "
        "write it once with all its options",
    ),
    (
        "fsdp[Reshard=true,RESHARD=false]",
        "fsdp[Reshard=true,RESHARD=false]",
        "option 'reshard' is given twice in 'fsdp[Reshard=true,RESHARD=false]'; keep one",
    ),
    # malformed syntax
    ("   ", None, "empty target spec; write e.g. 'single', 'ddp+bf16' or 'fsdp+fp8'"),
    ("ddp++bf16", None, "empty part in 'ddp++bf16'; remove the extra '+'"),
    ("ddp+", None, "empty part in 'ddp+'; remove the extra '+'"),
    ("fsdp[", "fsdp[", "unclosed '[' in 'fsdp['; close it with ']'"),
    ("fsdp]", "fsdp]", "unmatched ']' in 'fsdp]'"),
    ("fsdp[a=[1]]", "fsdp[a=[1]]", "nested '[' in 'fsdp[a=[1]]'"),
    (
        "fsdp[reshard]",
        "fsdp[reshard]",
        "option 'reshard' in 'fsdp[reshard]' needs a value: reshard=<value>",
    ),
    ("fsdp[=1]", "fsdp[=1]", "missing option name before '=' in 'fsdp[=1]'"),
    (
        "fsdp[reshard=]",
        "fsdp[reshard=]",
        "option 'reshard' in 'fsdp[reshard=]' has no value after '='",
    ),
    ("fsdp[]", "fsdp[]", "empty brackets in 'fsdp[]'; write key=value or drop them"),
    (
        "fsdp[reshard=true,]",
        "fsdp[reshard=true,]",
        "empty option in 'fsdp[reshard=true,]'; remove the stray ','",
    ),
    ("[a=1]", "[a=1]", "missing part name before '[' in '[a=1]'"),
    (
        "fsdp[reshard=true]x",
        "fsdp[reshard=true]x",
        "text after ']' in 'fsdp[reshard=true]x'; separate parts with '+'",
    ),
    (
        "ddp bf16",
        "ddp bf16",
        "bad part 'ddp bf16': names use letters, digits, '_' and '-'; separate parts with '+'",
    ),
    # options of one part that do not go together
    (
        "fp8[scaling=rowwise,backend=te]",
        "fp8[scaling=rowwise,backend=te]",
        "scaling=rowwise in 'fp8[scaling=rowwise,backend=te]' needs backend=torchao|native, "
        "but backend is te: only they scale per row",
    ),
    (
        "fp8[opt_level=o1]",
        "fp8[opt_level=o1]",
        "opt_level=o1 in 'fp8[opt_level=o1]' needs backend=msamp, but backend is auto: "
        "it is an MS-AMP setting",
    ),
    (
        "fp8[override_linear_precision=false|true|false,backend=msamp]",
        "fp8[override_linear_precision=false|true|false,backend=msamp]",
        "override_linear_precision=false|true|false in "
        "'fp8[override_linear_precision=false|true|false,backend=msamp]' needs "
        "backend=auto|te|native, but backend is msamp: it is a TE recipe setting, which te "
        "and native implement",
    ),
    (
        "fp8[scaling=current,amax_history=3]",
        "fp8[scaling=current,amax_history=3]",
        "amax_history=3 in 'fp8[scaling=current,amax_history=3]' needs scaling=delayed, but "
        "scaling is current: only delayed scaling keeps an amax history",
    ),
    (
        "ac[policy=budget]",
        "ac[policy=budget]",
        "policy=budget in 'ac[policy=budget]' needs budget, but budget is not set: "
        "write e.g. ac[budget=0.5] or ac[budget=8GiB]",
    ),
    (
        "ac[policy=full,budget=0.5]",
        "ac[policy=full,budget=0.5]",
        "budget=0.5 in 'ac[policy=full,budget=0.5]' needs policy=budget, but policy is full: "
        "a budget applies to policy=budget only",
    ),
    (
        "fsdp+offload[params=false,optimizer=false]",
        "offload[params=false,optimizer=false]",
        "params=false in 'offload[params=false,optimizer=false]' needs optimizer=true, but "
        "optimizer is false: otherwise nothing is offloaded",
    ),
    # conflicts between parts
    (
        "ddp+fsdp",
        "fsdp",
        "'ddp' and 'fsdp' are both distribution strategies; pick one "
        "(ddp replicates parameters, fsdp shards parameters)",
    ),
    (
        "ddp+single",
        "ddp",
        "'single' and 'ddp' are both distribution strategies; pick one "
        "(single runs one process, ddp replicates parameters)",
    ),
    (
        "ddp+tp",
        "tp",
        "'ddp' and 'tp' do not combine: DistributedDataParallel all-reduces every gradient over "
        "all ranks, but tp's parameters are DTensor shards that differ between the ranks of a tp "
        "group and DDP does not take DTensors; tensor parallelism runs alone (tp[size] = the "
        "number of processes) or under FSDP2 over the data-parallel dimension of a (dp, tp) "
        "mesh (fsdp+tp, zero2+tp, zero3+tp)",
    ),
    (
        "single+tp",
        "tp",
        "'single' and 'tp' do not combine: 'single' runs one process; tensor parallelism runs "
        "alone (tp[size] = the number of processes) or under FSDP2 over the data-parallel "
        "dimension of a (dp, tp) mesh (fsdp+tp, zero2+tp, zero3+tp)",
    ),
    (
        "fp16+bf16",
        "fp16",
        "'bf16' and 'fp16' are both autocast dtypes; pick one (bf16 needs no loss scaling)",
    ),
    (
        "fp16+fp8",
        "fp8",
        "'fp16' and 'fp8' do not combine: fp8 runs the other ops in bf16; use bf16+fp8",
    ),
    (
        "offload",
        "offload",
        "'offload' needs one of 'fsdp', 'zero2', 'zero3', 'hsdp': "
        "offload moves sharded state to the CPU",
    ),
    (
        "zero1+offload",
        "offload",
        "'offload' needs one of 'fsdp', 'zero2', 'zero3', 'hsdp': "
        "offload moves sharded state to the CPU",
    ),
    (
        "fsdp+fp16-comm",
        "fp16-comm",
        "'fp16-comm' needs one of 'ddp', 'zero1': comm hooks change DDP's gradient all-reduce",
    ),
    (
        "powersgd",
        "powersgd",
        "'powersgd' needs one of 'ddp', 'zero1': comm hooks change DDP's gradient all-reduce",
    ),
    (
        "ddp+fp16-comm+bf16-comm",
        "bf16-comm",
        "'fp16-comm' and 'bf16-comm' both cast gradients for the all-reduce; pick one",
    ),
    (
        "ddp+powersgd+fp16-comm",
        "fp16-comm",
        "'powersgd' and 'fp16-comm' are both DDP comm hooks and DDP takes one: write "
        "them as one hook, e.g. ddp+powersgd[wrapper=fp16]",
    ),
    (
        "ddp+bf16-comm+powersgd",
        "bf16-comm",
        "'powersgd' and 'bf16-comm' are both DDP comm hooks and DDP takes one: write "
        "them as one hook, e.g. ddp+powersgd[wrapper=bf16]",
    ),
    (
        "xla+bf16+compile",
        "compile",
        "'xla' does not combine with 'compile': XLA compiles and distributes the whole step "
        "itself (xla[sharding=fsdp] shards the blocks over its devices); of the other parts only "
        "bf16 (autocast on XLA) is implemented there",
    ),
    (
        "bf16[downcast=true]",
        "bf16",
        "bf16[downcast=true] needs 'xla': it is XLA's XLA_DOWNCAST_BF16",
    ),
]


@pytest.mark.parametrize(("spec", "part", "message"), ERRORS, ids=[e[0] for e in ERRORS])
def test_error_messages(spec, part, message):
    with pytest.raises(TargetError) as info:
        parse_target(spec)
    assert str(info.value) == message
    assert info.value.part == part
    assert isinstance(info.value, ValueError)


# --- property tests -----------------------------------------------------------------------------

GRAMMAR = " +[]=,|.0123456789abcdefgiklmnoprstuwxyzBDFGKMS_-"


@settings(max_examples=300, deadline=None)
@given(st.one_of(st.text(max_size=40), st.text(alphabet=GRAMMAR, max_size=40)))
def test_junk_gives_a_target_or_a_target_error(spec):
    try:
        target = parse_target(spec)
    except TargetError:
        return
    assert parse_target(str(target)) == target


def option_values(opt: Option) -> st.SearchStrategy:
    high = 1e6 if opt.high is None else opt.high
    by_kind = {
        "bool": st.booleans(),
        "int": st.integers(min_value=int(opt.low or 0), max_value=10**7),
        "float": st.floats(
            opt.low, high, exclude_min=opt.strict, exclude_max=opt.strict, allow_nan=False
        ),
        "enum": st.sampled_from(opt.choices or ("",)),
        "name": st.sampled_from(("inductor", "aot_eager", "eager", "cudagraphs")),
        "ref": st.sampled_from((*opt.choices, "pkg.plans:PLAN", "tests.tp_models:LLAMA_2")),
        "list": st.lists(
            st.sampled_from(opt.choices)
            if opt.choices
            else st.from_regex(r"[a-z_][a-z.*?]{0,6}", fullmatch=True),
            unique=True,
            max_size=3,
        ),
        "bools": st.tuples(st.booleans(), st.booleans(), st.booleans()),
        "budget": st.one_of(
            st.floats(0, 1, exclude_min=True), st.integers(min_value=10**6, max_value=10**13)
        ),
    }
    return by_kind[opt.kind]


@st.composite
def part_options(draw, name):
    schema = PARTS[name].options
    keys = draw(st.lists(st.sampled_from(sorted(schema)), unique=True)) if schema else []
    options = {key: draw(option_values(schema[key])) for key in keys}
    try:
        Part(name, options)
    except TargetError:  # options of one part that do not go together
        options = {}
    return options


@st.composite
def valid_targets(draw):
    strategy = draw(st.sampled_from((None, *STRATEGIES)))
    names = [strategy] if strategy else []
    if strategy == "xla":
        names += draw(st.sampled_from(([], ["bf16"])))
    else:
        names += draw(st.sampled_from(([], ["bf16"], ["fp16"], ["fp8"], ["bf16", "fp8"])))
        names += [n for n in ("ac", "compile") if draw(st.booleans())]
    tp_fits = "fp8" not in names
    if strategy in (None, "fsdp", "zero2", "zero3") and tp_fits and draw(st.booleans()):
        names.append("tp")
    if strategy in ("fsdp", "zero2", "zero3", "hsdp") and "tp" not in names and draw(st.booleans()):
        names.append("offload")
    if strategy in ("ddp", "zero1"):
        names += draw(st.sampled_from(([], ["powersgd"], ["fp16-comm"], ["bf16-comm"])))
    names = names or ["single"]
    options = {name: draw(part_options(name)) for name in draw(st.permutations(names))}
    if "xla" not in names and "bf16" in options:
        options["bf16"].pop("downcast", None)
    if "ac" in options and "compile" in options:  # scope=whole has no blocks to checkpoint
        options["compile"].pop("scope", None)
    return Target.from_dict(options)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(valid_targets())
def test_valid_targets_round_trip(target):
    text = str(target)
    assert parse_target(text) == target
    assert str(parse_target(text)) == text
    assert parse_target(f"  {text.replace('+', ' + ')}  ") == target
