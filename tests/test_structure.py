"""The import structure: no circle among the package modules, and no import from a lower layer to a higher one
(data flows conversations -> generator & discriminator -> adversary -> agent_rl). Read from the source, every
import statement (function-level ones too: a lazy import is still a dependency)."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LAYERS = {"conversations": 0, "generator": 1, "discriminator": 1, "adversary": 2, "agent_rl": 3}


def _module(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    mods = {_module(p): p for pkg in LAYERS for p in (ROOT / pkg).rglob("*.py")}
    graph = {}
    for name, path in mods.items():
        deps = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module] if isinstance(node, ast.ImportFrom) and node.module and node.level == 0 else []
            for t in targets:
                # the longest of our modules that the target names (a package's __init__ counts as the package)
                while t and t not in mods:
                    t = t.rpartition(".")[0]
                if t and t != name:
                    deps.add(t)
        graph[name] = deps
    return graph


def test_no_import_from_a_lower_layer_to_a_higher_one():
    bad = [(a, b) for a, deps in import_graph().items() for b in deps
           if LAYERS[b.split(".")[0]] > LAYERS[a.split(".")[0]]]
    assert not bad, f"imports against the data flow: {bad}"


def test_generator_and_discriminator_do_not_import_each_other():
    bad = [(a, b) for a, deps in import_graph().items() for b in deps
           if {a.split(".")[0], b.split(".")[0]} == {"generator", "discriminator"}]
    assert not bad, bad


def test_no_import_circle():
    graph = import_graph()
    # package __init__ files that only re-export are edges of their own package: leave them out of the cycle search
    state, stack, cycles = {}, [], []

    def visit(n):
        state[n] = 1
        stack.append(n)
        for m in graph.get(n, ()):
            if m.endswith("__init__"):
                continue
            if state.get(m) == 1:
                cycles.append(stack[stack.index(m):] + [m])
            elif m not in state:
                visit(m)
        stack.pop()
        state[n] = 2

    for n in sorted(graph):
        if n not in state:
            visit(n)
    cycles = [c for c in cycles if not any("." not in x for x in c)]  # a package importing its own __init__ names
    assert not cycles, f"import circles: {cycles}"


def test_no_package_file_over_450_lines():
    long = {str(p.relative_to(ROOT)): n for pkg in LAYERS for p in (ROOT / pkg).rglob("*.py")
            if (n := len(p.read_text().splitlines())) > 450}
    assert not long, f"split these by concern: {long}"


def test_one_seed_formula():
    from conversations.seeds import derive_seed

    assert derive_seed(5) == 5 and derive_seed(5, step=3, rank=1) == 5 + 1_000_003 + 3 * 7_919
    assert derive_seed(0, stream=1) != derive_seed(0, step=1) != derive_seed(0, rank=1)
    # the formula is written once: no module spells the rank/step offsets out again
    spelled = [str(p.relative_to(ROOT)) for pkg in LAYERS for p in (ROOT / pkg).rglob("*.py")
               if "1_000_003 * rank" in p.read_text() and p.name != "seeds.py"]
    assert not spelled, spelled


def test_every_fixed_seed_stream_is_named_in_one_block():
    """The older fixed streams (seed + 2, seed * 7919 + k, ...) keep their values (the pinned figures were recorded
    with them) and are written once, by name, in conversations.seeds: no module does arithmetic on a seed itself."""
    import re

    from conversations.seeds import seed_for

    assert seed_for("fit_samples", 7) == 9 and seed_for("val_split", 7) == 12 and seed_for("gym_split", 0) == 1
    assert seed_for("meter_seed", 1234, 2) == 3234 and seed_for("assistant_call", 3, 4) == 4003
    assert seed_for("round_pass", 2, 5) == 2 * 1_000_003 + 5 and seed_for("plateau_samples", 3, 1) == 3 * 7919 + 1
    assert seed_for("agent_episode", 4, 6) == 4 * 100_003 + 6 and seed_for("dropout_step", 1, 9) == 1_000_012
    arithmetic = re.compile(r"(?i)\b(\w*_)?seed\s*[-+*]\s*\d|\b(step|calls)\s*\*\s*\d")
    spelled = [f"{p.relative_to(ROOT)}:{n}" for pkg in LAYERS for p in (ROOT / pkg).rglob("*.py")
               if p.name != "seeds.py" for n, line in enumerate(p.read_text().splitlines(), 1)
               if arithmetic.search(line.split("#")[0]) and "seed_for" not in line]
    assert not spelled, f"name the stream in conversations.seeds.STREAMS and call seed_for: {spelled}"


def test_one_way_into_the_engine_for_a_policy_being_trained():
    """`generator.engine.policy_model` / `policy_engine` are how a model or trainer gets ready for the engine: no
    module outside the engine package makes the inference copy itself."""
    direct = [str(p.relative_to(ROOT)) for pkg in LAYERS for p in (ROOT / pkg).rglob("*.py")
              if p.parent.name != "engine" and any(f"{f}(" in p.read_text() for f in ("inference_copy", "inference_model"))]
    assert not direct, f"use generator.engine.policy_engine / policy_model: {direct}"


WHOLE_CONFIG_CALLS = {"resolved", "resolved_config", "fields", "deepcopy", "to_jsonable", "arm_config"}


def _config_functions() -> list[dict]:
    """Every function of the main job's package (adversary/) that takes `cfg`: its annotation, the config keys it
    reads from `cfg` itself, and the functions it hands `cfg` on to (by name)."""
    found = []
    for path in sorted((ROOT / "adversary").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            arg = next((a for a in node.args.args + node.args.kwonlyargs if a.arg == "cfg"), None)
            if arg is None:
                continue
            reads, callees = set(), set()
            for sub in ast.walk(node):
                if isinstance(sub, ast.Attribute) and isinstance(sub.value, ast.Name) and sub.value.id == "cfg":
                    reads.add(sub.attr)
                if isinstance(sub, ast.Call) and any(isinstance(v, ast.Name) and v.id == "cfg"
                                                     for v in sub.args + [k.value for k in sub.keywords]):
                    f = sub.func
                    callees.add(f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", ""))
            found.append({"where": f"{path.relative_to(ROOT)}:{node.lineno} {node.name}", "name": node.name,
                          "annotation": ast.unparse(arg.annotation) if arg.annotation else None,
                          "reads": reads, "callees": callees})
    return found


def test_functions_take_the_config_parts_they_read():
    """A function of the main job that takes the config says which of its parts it needs: `cfg: MeterArgs` reads the
    meter's keys only, and hands `cfg` on only to functions of the same part; a function that composes several parts
    (a stage, the study's arms) takes `cfg: AdversaryConfig`. So a reader sees at the signature what a function
    depends on, and a test, not a convention, keeps it true."""
    import dataclasses

    from adversary.config import PARTS, AdversaryConfig, own_fields

    owner = {}  # config key -> its part; a part's inherited keys (LoraArgs') belong to it too
    for name, part in PARTS.items():
        for f in dataclasses.fields(part):
            owner.setdefault(f.name, name)
        owner.update({f: name for f in own_fields(part)})
        for cls in part.__mro__:  # a part's methods (LoraArgs.peft_config) read its keys
            if cls.__module__ != "builtins":
                owner.update({m: owner.get(m, name) for m, v in vars(cls).items()
                              if callable(v) and not m.startswith("_")})
    by_class = {part.__name__: name for name, part in PARTS.items()}
    fns = _config_functions()
    by_name: dict[str, list] = {}
    for fn in fns:
        by_name.setdefault(fn["name"], []).append(fn)

    def parts_of(fn, seen=()) -> set:
        """The parts a function needs, through the functions it hands cfg on to ('*': the whole config)."""
        out = {"*" if k in ("part", "__post_init__") else owner.get(k, "?" + k) for k in fn["reads"]}
        for c in fn["callees"]:
            if c in WHOLE_CONFIG_CALLS or (c[:1].isupper() and not c.endswith("Args")):
                out.add("*")  # the whole config read, or held by an object for its methods (Phase, AdversaryState)
            for callee in by_name.get(c, []):
                if callee["where"] not in seen:
                    out |= parts_of(callee, seen + (fn["where"],))
        return out

    problems = []
    for fn in fns:
        ann, need = fn["annotation"], parts_of(fn)
        unknown = sorted(p for p in need if p.startswith("?"))
        if unknown:
            problems.append(f"{fn['where']}: reads {unknown}, not a config key")
        elif ann in by_class:
            if need != {by_class[ann]}:
                problems.append(f"{fn['where']}: typed {ann} but needs the parts {sorted(need)}")
        elif ann == AdversaryConfig.__name__:
            if fn["name"] != "__init__" and len(need) < 2 and "*" not in need:
                problems.append(f"{fn['where']}: takes the whole AdversaryConfig but needs only {sorted(need)}")
        else:
            problems.append(f"{fn['where']}: cfg is not typed with its part (one of {sorted(by_class)}) "
                            f"or AdversaryConfig (annotation: {ann})")
    assert not problems, "\n".join(problems)
    assert len(fns) >= 40  # the walk saw the package
