"""The target spec (target/grammar.py) and Accelerate config files (target/accelerate_yaml.py)."""

from __future__ import annotations

import textwrap

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from retarget.target.accelerate_yaml import AccelerateConfig, read_accelerate_config
from retarget.target.grammar import (
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
COMPANION = {"offload": "fsdp", "powersgd": "ddp", "fp16-comm": "ddp", "bf16-comm": "ddp"}


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
    "fsdp+tp[sequence_parallel=true,size=4]",
    "xla[spmd=false]+bf16[autocast_eval=false,downcast=true,keep_fp32=cumsum|exp]",
    "fp16[autocast_eval=false,backoff_factor=0.25,growth_factor=4.0,growth_interval=100,"
    "init_scale=1024.0,keep_fp32=none]",
    "fp8[amax_algo=max,amax_history=1024,autocast_eval=true,backend=te,exclude=lm_head,"
    "format=e4m3,include=layers.*|mlp?,interval=2,margin=1,min_size=0,"
    "override_linear_precision=true|false|false]",
    "fp8[backend=msamp,opt_level=o1]",
    "fp8[backend=torchao,scaling=rowwise]",
    "fp8[scaling=current]",
    "ac[every=2,policy=selective]",
    "ac[budget=0.5]",
    "fsdp+offload[optimizer=false,pin_memory=true]",
    "fsdp+offload[params=false]",
    "compile[backend=aot_eager,dynamic=false,fullgraph=true,mode=reduce-overhead,regional=true]",
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
        ("fsdp+tp+ac+bf16+compile", "fsdp+tp+bf16+ac+compile"),
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
        "hsdp, tp, xla, bf16, fp16, fp8, ac, offload, compile, powersgd, fp16-comm, bf16-comm",
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
        "'ddp' and 'tp' do not combine: tensor parallelism composes with sharded data parallel "
        "only, and no pass implements 'tp' yet; to split a model too large for one process, "
        "use 'fsdp'",
    ),
    (
        "single+tp",
        "tp",
        "'single' and 'tp' do not combine: tensor parallelism composes with sharded data parallel "
        "only, and no pass implements 'tp' yet; to split a model too large for one process, "
        "use 'fsdp'",
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
        "'powersgd' and 'fp16-comm' are both DDP comm hooks and DDP takes one; "
        "use powersgd[wrapper=fp16]",
    ),
    (
        "ddp+bf16-comm+powersgd",
        "bf16-comm",
        "'powersgd' and 'bf16-comm' are both DDP comm hooks and DDP takes one; "
        "use powersgd[wrapper=bf16]",
    ),
    (
        "xla+bf16+compile",
        "compile",
        "'xla' does not combine with 'compile': XLA compiles and distributes the whole program, "
        "and no pass implements 'xla' yet; drop 'xla' to run on this process's device",
    ),
    (
        "bf16[downcast=true]",
        "bf16",
        "bf16[downcast=true] needs 'xla': it is XLA's XLA_DOWNCAST_BF16, and no pass implements "
        "'xla' yet; drop downcast",
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
    if strategy in (None, "fsdp", "zero2", "zero3", "hsdp") and draw(st.booleans()):
        names.append("tp")
    if strategy in ("fsdp", "zero2", "zero3", "hsdp") and draw(st.booleans()):
        names.append("offload")
    if strategy in ("ddp", "zero1"):
        names += draw(st.sampled_from(([], ["powersgd"], ["fp16-comm"], ["bf16-comm"])))
    names = names or ["single"]
    options = {name: draw(part_options(name)) for name in draw(st.permutations(names))}
    if "xla" not in names and "bf16" in options:
        options["bf16"].pop("downcast", None)
    return Target.from_dict(options)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(valid_targets())
def test_valid_targets_round_trip(target):
    text = str(target)
    assert parse_target(text) == target
    assert str(parse_target(text)) == text
    assert parse_target(f"  {text.replace('+', ' + ')}  ") == target


# --- Accelerate config files --------------------------------------------------------------------


def write(tmp_path, text: str, name: str = "config.yaml") -> str:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return str(path)


def test_multi_gpu_bf16(tmp_path):
    path = write(
        tmp_path,
        """
        compute_environment: LOCAL_MACHINE
        debug: false
        distributed_type: MULTI_GPU
        downcast_bf16: 'no'
        enable_cpu_affinity: false
        gpu_ids: all
        machine_rank: 1
        main_process_ip: 10.0.0.1
        main_process_port: 29500
        main_training_function: main
        mixed_precision: bf16
        num_machines: 2
        num_processes: 16
        rdzv_backend: c10d
        same_network: false
        tpu_env: []
        tpu_use_cluster: false
        tpu_use_sudo: false
        use_cpu: false
        """,
    )
    config = read_accelerate_config(path)
    assert config == AccelerateConfig(
        target=parse_target("ddp+bf16"),
        num_processes=16,
        num_machines=2,
        machine_rank=1,
        main_process_ip="10.0.0.1",
        main_process_port=29500,
        gradient_accumulation_steps=1,
        use_cpu=False,
        source=path,
        gpu_ids="all",
        rdzv_backend="c10d",
    )
    assert Target.from_yaml(path) == config.target


def test_fsdp_full_shard_with_offload_and_checkpointing(tmp_path):
    path = write(
        tmp_path,
        """
        compute_environment: LOCAL_MACHINE
        distributed_type: FSDP
        downcast_bf16: 'no'
        fsdp_config:
          fsdp_activation_checkpointing: true
          fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP
          fsdp_backward_prefetch: BACKWARD_PRE
          fsdp_cpu_ram_efficient_loading: true
          fsdp_forward_prefetch: false
          fsdp_offload_params: true
          fsdp_sharding_strategy: FULL_SHARD
          fsdp_state_dict_type: FULL_STATE_DICT
          fsdp_sync_module_states: true
          fsdp_transformer_layer_cls_to_wrap: LlamaDecoderLayer
          fsdp_use_orig_params: true
        machine_rank: 0
        mixed_precision: bf16
        num_machines: 1
        num_processes: 8
        use_cpu: false
        """,
    )
    config = read_accelerate_config(path)
    assert (
        str(config.target) == "fsdp[cpu_ram_efficient_loading=true,state_dict=full]+bf16+ac+offload"
    )
    assert (config.num_processes, config.num_machines, config.machine_rank) == (8, 1, 0)


def test_fsdp2_without_reshard_after_forward_is_zero2(tmp_path):
    path = write(
        tmp_path,
        """
        distributed_type: FSDP
        fsdp_config:
          fsdp_version: 2
          fsdp_reshard_after_forward: false
          fsdp_auto_wrap_policy: SIZE_BASED_WRAP
          fsdp_min_num_params: 100000000
          fsdp_state_dict_type: SHARDED_STATE_DICT
          fsdp_cpu_ram_efficient_loading: false
        mixed_precision: 'no'
        num_processes: 4
        """,
    )
    assert str(Target.from_yaml(path)) == "zero2[min_params=100000000]"


@pytest.mark.parametrize(
    ("strategy", "expected"),
    [
        ("1", "fsdp"),
        ("SHARD_GRAD_OP", "zero2"),
        ("3", "ddp"),
        ("HYBRID_SHARD", "hsdp"),
        ("5", "hsdp[reshard=false]"),
        ("hybrid_shard_zero2", "hsdp[reshard=false]"),
    ],
)
def test_fsdp_sharding_strategies(tmp_path, strategy, expected):
    text = f"distributed_type: FSDP\nfsdp_config:\n  fsdp_sharding_strategy: {strategy}\n"
    assert str(Target.from_yaml(write(tmp_path, text))) == expected


def test_deepspeed_zero2_with_optimizer_offload(tmp_path):
    path = write(
        tmp_path,
        """
        compute_environment: LOCAL_MACHINE
        deepspeed_config:
          gradient_accumulation_steps: 4
          offload_optimizer_device: cpu
          offload_param_device: none
          zero3_init_flag: false
          zero_stage: 2
        distributed_type: DEEPSPEED
        mixed_precision: fp16
        num_machines: 1
        num_processes: 4
        """,
    )
    config = read_accelerate_config(path)
    assert str(config.target) == "zero2+fp16+offload[params=false]"
    assert config.gradient_accumulation_steps == 4
    assert config.num_processes == 4


@pytest.mark.parametrize(("stage", "expected"), [(0, "ddp"), (1, "zero1"), (3, "zero3")])
def test_deepspeed_stages(tmp_path, stage, expected):
    text = f"distributed_type: DEEPSPEED\ndeepspeed_config:\n  zero_stage: {stage}\n"
    assert str(Target.from_yaml(write(tmp_path, text))) == expected


def test_fp8_with_transformer_engine_recipe(tmp_path):
    path = write(
        tmp_path,
        """
        distributed_type: MULTI_GPU
        mixed_precision: fp8
        num_processes: 2
        fp8_config:
          backend: TE
          fp8_format: E4M3
          amax_history_length: 512
          amax_compute_algorithm: max
          margin: 1
          interval: 1
          override_linear_precision: [false, false, true]
          use_autocast_during_eval: false
        """,
    )
    assert str(Target.from_yaml(path)) == (
        "ddp+bf16+fp8[amax_algo=max,amax_history=512,backend=te,format=e4m3,margin=1,"
        "override_linear_precision=false|false|true]"
    )


def test_fp8_backend_defaults_follow_accelerate(tmp_path):
    te = write(tmp_path, "distributed_type: NO\nmixed_precision: fp8\nfp8_config:\n  backend: TE\n")
    assert str(Target.from_yaml(te)) == "single+bf16+fp8[amax_history=1024,backend=te]"
    ao = write(tmp_path, "distributed_type: NO\nmixed_precision: fp8\nfp8_config:\n  backend: AO\n")
    assert str(Target.from_yaml(ao)) == "single+bf16+fp8[backend=torchao,scaling=current]"


def test_dynamo_inductor(tmp_path):
    path = write(
        tmp_path,
        """
        distributed_type: MULTI_GPU
        num_processes: 2
        mixed_precision: bf16
        dynamo_config:
          dynamo_backend: INDUCTOR
          dynamo_mode: max-autotune
          dynamo_use_fullgraph: true
          dynamo_use_regional_compilation: true
        """,
    )
    assert str(Target.from_yaml(path)) == (
        "ddp+bf16+compile[dynamic=false,fullgraph=true,mode=max-autotune,regional=true]"
    )


def test_old_format_keys(tmp_path):
    path = write(tmp_path, "distributed_type: NO\nfp16: true\ndynamo_backend: EAGER\n")
    assert str(Target.from_yaml(path)) == "single+fp16+compile[backend=eager,dynamic=false]"


def test_cpu_single_process(tmp_path):
    path = write(
        tmp_path,
        """
        compute_environment: LOCAL_MACHINE
        distributed_type: 'NO'
        mixed_precision: 'no'
        use_cpu: true
        ipex_config:
          ipex: false
        dynamo_config: {}
        """,
    )
    config = read_accelerate_config(path)
    assert str(config.target) == "single"
    assert (config.num_processes, config.use_cpu, config.gradient_accumulation_steps) == (
        1,
        True,
        1,
    )


def test_xla_with_downcast_and_tp(tmp_path):
    xla = write(tmp_path, "distributed_type: XLA\nmixed_precision: bf16\ndowncast_bf16: 'yes'\n")
    assert str(Target.from_yaml(xla)) == "xla+bf16[downcast=true]"
    tp = write(tmp_path, "distributed_type: TP\ntp_config:\n  tp_size: 4\n")
    assert str(Target.from_yaml(tp)) == "tp[size=4]"


YAML_ERRORS = [
    (
        "distributed_type: NO\nfsdp_confg: {}\n",
        "fsdp_confg: unknown key; did you mean 'fsdp_config'?",
    ),
    (
        "distributed_type: FSDP\nfsdp_config:\n  fsdp_sharding_stratgy: 1\n",
        "fsdp_config.fsdp_sharding_stratgy: unknown key; did you mean 'fsdp_sharding_strategy'?",
    ),
    (
        "distributed_type: FSDP\nfsdp_config:\n  fsdp_sharding_strategy: 1\n"
        "  fsdp_reshard_after_forward: false\n",
        "fsdp_config: fsdp_sharding_strategy means 'fsdp' but fsdp_reshard_after_forward means "
        "'zero2'; keep one of them",
    ),
    (
        "distributed_type: FSDP\nfsdp_config:\n  fsdp_auto_wrap_policy: NO_WRAP\n",
        "fsdp_config.fsdp_auto_wrap_policy: 'NO_WRAP' cannot be honoured: each repeated block is "
        "its own unit",
    ),
    (
        "distributed_type: FSDP\nfsdp_config:\n  fsdp_state_dict_type: LOCAL_STATE_DICT\n",
        "fsdp_config.fsdp_state_dict_type: 'LOCAL_STATE_DICT' is not one of FULL_STATE_DICT, "
        "SHARDED_STATE_DICT; did you mean 'FULL_STATE_DICT'?",
    ),
    (
        "distributed_type: FSDP\nfsdp_config:\n  fsdp_sharding_strategy: NO_SHARD\n"
        "  fsdp_state_dict_type: FULL_STATE_DICT\n",
        "fsdp_config.fsdp_state_dict_type: 'full' has no meaning for 'ddp'; remove it",
    ),
    (
        "distributed_type: MULTI_GPU\nfsdp_config:\n  fsdp_sharding_strategy: 1\n",
        "fsdp_config: is set but distributed_type is MULTI_GPU; remove it, or use FSDP",
    ),
    (
        "distributed_type: MEGATRON_LM\n",
        "distributed_type: MEGATRON_LM cannot be honoured (no pass implements tensor "
        "parallelism yet); to split a model too large for one process, use FSDP",
    ),
    (
        "distributed_type: MULTI_GPUS\n",
        "distributed_type: 'MULTI_GPUS' is not one of NO, MULTI_GPU, MULTI_CPU, MULTI_XPU, "
        "MULTI_NPU, MULTI_MLU, MULTI_MUSA, MULTI_HPU, FSDP, DEEPSPEED, XLA, TPU, TP; "
        "did you mean 'MULTI_GPU'?",
    ),
    (
        "mixed_precision: bf16\n",
        "distributed_type: missing; set one of NO, MULTI_GPU, MULTI_CPU, MULTI_XPU, MULTI_NPU, "
        "MULTI_MLU, MULTI_MUSA, MULTI_HPU, FSDP, DEEPSPEED, XLA, TPU, TP",
    ),
    (
        "compute_environment: AMAZON_SAGEMAKER\ndistributed_type: NO\n",
        "compute_environment: AMAZON_SAGEMAKER cannot be honoured: run on the machine",
    ),
    (
        "distributed_type: NO\ndebug: true\n",
        "debug: True cannot be honoured: distributed debug checks (ACCELERATE_DEBUG_MODE) are not "
        "implemented",
    ),
    (
        "distributed_type: NO\ntpu_name: my-pod\n",
        "tpu_name: 'my-pod' cannot be honoured: launching on TPU pods is not supported",
    ),
    (
        "distributed_type: NO\nmegatron_lm_config:\n  megatron_lm_tp_degree: 2\n",
        "megatron_lm_config: {'megatron_lm_tp_degree': 2} cannot be honoured: Megatron-LM is not "
        "supported",
    ),
    (
        "distributed_type: DEEPSPEED\ndeepspeed_config:\n  zero_stage: 3\n"
        "  offload_param_device: nvme\n",
        "deepspeed_config.offload_param_device: nvme offload cannot be honoured; use cpu or none",
    ),
    (
        "distributed_type: DEEPSPEED\ndeepspeed_config:\n  zero_stage: 2\n"
        "  gradient_clipping: 1.0\n",
        "deepspeed_config.gradient_clipping: 1.0 cannot be honoured: clip in the training loop "
        "with clip_grad_norm_",
    ),
    (
        "distributed_type: DEEPSPEED\ndeepspeed_config:\n  zero_stage: 1\n"
        "  offload_optimizer_device: cpu\n",
        "'offload' needs one of 'fsdp', 'zero2', 'zero3', 'hsdp': offload moves sharded state to "
        "the CPU",
    ),
    (
        "distributed_type: NO\nmixed_precision: bf16\nfp8_config:\n  backend: TE\n",
        "fp8_config: is set but mixed_precision is bf16; remove it, or use fp8",
    ),
    (
        "distributed_type: NO\nmixed_precision: fp8\nfp8_config:\n  backend: TEE\n",
        "fp8_config.backend: 'TEE' is not one of TE, MSAMP, MS-AMP, AO; did you mean 'TE'?",
    ),
    (
        "distributed_type: NO\nmixed_precision: fp8\nfp8_config:\n  amax_history_len: 0\n",
        "fp8_config.amax_history_len: bad value 0: must be >= 1",
    ),
    (
        "distributed_type: NO\ndynamo_config:\n  dynamo_backend: 'NO'\n"
        "  dynamo_use_fullgraph: true\n",
        "dynamo_config.dynamo_use_fullgraph: is set but dynamo_backend is NO; remove it",
    ),
    (
        "distributed_type: NO\nmixed_precision: fp16\ndowncast_bf16: 'yes'\n",
        "downcast_bf16: applies only with mixed_precision: bf16",
    ),
    (
        "distributed_type: MULTI_GPU\nmixed_precision: bf16\ndowncast_bf16: 'yes'\n",
        "bf16[downcast=true] needs 'xla': it is XLA's XLA_DOWNCAST_BF16, and no pass implements "
        "'xla' yet; drop downcast",
    ),
    (
        "distributed_type: MULTI_GPU\nnum_machines: 2\nmachine_rank: 2\n",
        "machine_rank: must be below num_machines (2), got 2",
    ),
    (
        "distributed_type: NO\nnum_processes: 4\n",
        "num_processes: distributed_type NO runs one process, got 4",
    ),
    (
        "distributed_type: MULTI_GPU\nnum_processes: many\n",
        "num_processes: expected an integer, got 'many'",
    ),
    (
        "distributed_type: MULTI_GPU\nuse_cpu: maybe\n",
        "use_cpu: expected true or false, got 'maybe'",
    ),
]


@pytest.mark.parametrize(
    ("text", "message"), YAML_ERRORS, ids=[m.split(":")[0] for _, m in YAML_ERRORS]
)
def test_yaml_errors_name_the_file_and_key(tmp_path, text, message):
    path = write(tmp_path, text)
    with pytest.raises(TargetError) as info:
        read_accelerate_config(path)
    assert str(info.value) == f"{path}: {message}"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("- distributed_type: NO\n", "expected a mapping of Accelerate config keys, got list"),
        ("", "expected a mapping of Accelerate config keys, got NoneType"),
        ("distributed_type: [NO\n", "not valid YAML: "),
    ],
)
def test_yaml_that_is_not_a_mapping(tmp_path, text, message):
    path = write(tmp_path, text)
    with pytest.raises(TargetError) as info:
        read_accelerate_config(path)
    assert str(info.value).startswith(f"{path}: {message}")
