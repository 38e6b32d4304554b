"""Render a CheckReport as a text table, JSON or JUnit XML."""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET

from runners.compare import ROUNDING_MULTIPLE
from runners.ort import placement_line
from toolkit.check.crosscheck import CheckReport
from toolkit.check.golden import ORIGINAL_NAME
from toolkit.check.oracle import layer_of


def _shape(shape) -> str:
    return "x".join(str(d) for d in shape)


def _err(value) -> str:
    return "n/a" if value is None or value != value else f"{value:.2e}"


def text_table(report: CheckReport) -> str:
    """Rows are stages in computation order, columns are backends: max abs error and a verdict."""
    names = [b.name for b in report.backends]
    stage_width = max(len("stage"), *(len(s) for s in report.stages))
    col = max(16, *(len(n) + 2 for n in names))
    header = f"{'stage':<{stage_width}}  {'shape':<12} {'allowed':>9}  " + "".join(f"{n:>{col}}" for n in names)
    lines = [
        f"artifact: {report.artifact}",
        f"inputs:   {', '.join(f'{k} {_shape(v)}' for k, v in report.inputs.items())} ({report.input_source})",
        "reference: eager-f64 (PyTorch float64); cells: max abs error vs reference, ok / FAIL",
        "",
        header,
        "-" * len(header),
    ]
    for stage in report.stages:
        first = report.backends[0].comparison[stage] if report.backends else None
        shape = _shape(first.reference_shape) if first else "?"
        allowed = _err(first.allowed) if first else "?"
        cells = ""
        for backend in report.backends:
            result = backend.comparison[stage]
            cells += f"{_err(result.max_abs) + (' ok' if result.passed else ' FAIL'):>{col}}"
        lines.append(f"{stage:<{stage_width}}  {shape:<12} {allowed:>9}  {cells}")
    lines.append("")
    for backend in report.backends:
        verdict = "PASS" if backend.passed else f"FAIL (first divergence: {backend.first_divergence})"
        extra = ""
        try:
            agreement = backend.comparison["logits"].argmax_agreement
            if agreement is not None:
                extra = f", logits arg-max agreement {agreement:.0%}"
        except KeyError:
            pass
        lines.append(f"{backend.name:<16} {verdict} on {backend.device}, {backend.seconds * 1e3:.1f} ms{extra}")
    if report.rounding:
        lines.append(
            f"int8 activations (accuracy level 4): allowances include {ROUNDING_MULTIPLE:g} x the oracle's move when "
            f"values within float32 noise of a half step round the other way (logits: {_err(report.rounding.get('logits'))})"
        )
    lines.extend(b.audit.describe() for b in report.backends if b.audit is not None)
    lines.extend(golden_lines(report))
    lines.extend(oracle_lines(report))
    for localization in report.localizations:
        lines.append(localization.describe())
    divergence = report.first_divergence
    if divergence:
        lines.append(
            f"first divergence: {divergence['backend']} at stage {divergence['stage']} "
            f"(#{divergence['index']} in computation order): {divergence['reason']}"
        )
    matches = "every backend matches the reference" + (
        " and the reference matches the original" if report.oracle else ""
    )
    lines.append("RESULT: " + (f"PASS, {matches}" if report.passed else "FAIL"))
    return "\n".join(lines)


def placement_lines(report: CheckReport) -> list[str]:
    """One line per backend that had a placement audit (GPU ONNX Runtime backends)."""
    return [f"placement {b.name}: {placement_line(b.placement)}" for b in report.backends if b.placement is not None]


def golden_lines(report: CheckReport) -> list[str]:
    """One line per comparison with the stored golden outputs, naming the first stage that drifted."""
    if not report.golden:
        return []
    info = report.golden_info
    then, now = info.get("versions_then", {}), info.get("versions_now", {})
    changed = [
        f"{k} {then.get(k)} -> {now.get(k)}"
        for k in ("torch", "onnx", "onnxruntime", "onnxscript", "toolkit")
        if then.get(k) != now.get(k)
    ]
    lines = [
        "",
        f"golden: {info.get('directory')} (saved {info.get('created')}; "
        + (f"versions changed: {', '.join(changed)}" if changed else "same versions")
        + "; graphs "
        + (f"CHANGED: {', '.join(info['graphs_changed'])}" if info.get("graphs_changed") else "unchanged")
        + ")",
    ]
    for result in report.golden:
        failure = result.comparison.first_failure
        if result.name == ORIGINAL_NAME:
            verdict = (
                "matches the stored original"
                if failure is None
                else f"LEAVES the stored original at stage {failure.name} ({layer_of(failure.name)}): {failure.reason}"
            )
        elif failure is None:
            verdict = "matches golden"
        else:
            verdict = (
                f"DRIFTED from golden at stage {failure.name}: {failure.reason}"
                if failure.reason
                else f"DRIFTED from golden at stage {failure.name}"
            )
        lines.append(f"golden {result.name:<16} {verdict}")
    if info.get("new_stages"):
        lines.append(f"golden: stages not in the golden outputs (not compared): {', '.join(info['new_stages'])}")
    return lines


def oracle_lines(report: CheckReport) -> list[str]:
    """--oracle: one row per compared stage (our float64 rebuild against the original), then the verdict naming the
    first layer that left tolerance."""
    oracle = report.oracle
    if oracle is None:
        return []
    if oracle.name == "llama.cpp":
        return llama_cpp_lines(report)
    info = report.oracle_info
    outputs = oracle.comparison.outputs
    width = max(len("stage"), *(len(o.name) for o in outputs))
    header = f"{'stage':<{width}}  {'shape':<12} {'allowed':>9}  {'max abs':>9}  verdict"
    lines = [
        "",
        f"oracle: {info.get('architecture')} from {info.get('checkpoint')} (sha256 verified) with transformers "
        f"{info.get('transformers')}, float32; cells: eager-f64 rebuilt from the artifact vs the original",
        header,
        "-" * len(header),
    ]
    for output in outputs:
        verdict = "ok" if output.passed else f"FAIL{': ' + output.reason if output.reason else ''}"
        position = info.get("first_position", {}).get(output.name)
        if position is not None:
            verdict += f", from position {position}"
        if output.argmax_agreement is not None:
            verdict += f" (arg-max agreement {output.argmax_agreement:.0%})"
        lines.append(
            f"{output.name:<{width}}  {_shape(output.reference_shape):<12} {_err(output.allowed):>9}  "
            f"{_err(output.max_abs):>9}  {verdict}"
        )
    failure = oracle.comparison.first_failure
    if failure is None:
        lines.append(f"oracle transformers: PASS, every stage matches the original ({oracle.seconds * 1e3:.0f} ms)")
    else:
        lines.append(
            f"oracle transformers: FAIL, first stage out of tolerance: {failure.name} ({layer_of(failure.name)}): "
            f"{failure.reason}"
        )
    return lines


def llama_cpp_lines(report: CheckReport) -> list[str]:
    """--oracle llama.cpp: the logits' relative RMS error on prefill and decode positions, greedy agreement."""
    oracle, info = report.oracle, report.oracle_info
    outputs = oracle.comparison.outputs
    width = max(len("stage"), *(len(o.name) for o in outputs))
    header = f"{'stage':<{width}}  {'shape':<14} {'allowed':>9}  {'rel RMS':>9}  {'max abs':>9}  verdict"
    lines = [
        "",
        f"oracle: llama.cpp {info.get('llama_cpp')} on {info.get('checkpoint')} (sha256 verified), "
        f"{info.get('precision')} weights; cells: eager-f64 rebuilt from the artifact vs llama.cpp's logits",
        header,
        "-" * len(header),
    ]
    for output in outputs:
        verdict = "ok" if output.passed else f"FAIL{': ' + output.reason if output.reason else ''}"
        if output.argmax_agreement is not None:
            verdict += f" (arg-max agreement {output.argmax_agreement:.0%})"
        lines.append(
            f"{output.name:<{width}}  {_shape(output.reference_shape):<14} {_err(output.allowed):>9}  "
            f"{_err(output.value):>9}  {_err(output.max_abs):>9}  {verdict}"
        )
    if info.get("greedy_agreement") is not None:
        lines.append(
            f"greedy agreement over llama.cpp's {info.get('decode_steps')} decode steps: "
            f"{info['greedy_agreement']:.0%} of our arg-max tokens are llama.cpp's"
        )
    failure = oracle.comparison.first_failure
    if failure is None:
        lines.append(f"oracle llama.cpp: PASS, the logits match llama.cpp's ({oracle.seconds * 1e3:.0f} ms)")
    else:
        lines.append(f"oracle llama.cpp: FAIL, {failure.name}: {failure.reason}")
    return lines


def to_json(report: CheckReport) -> str:
    return json.dumps(report.to_dict(), indent=2)


def to_junit(report: CheckReport) -> str:
    """One test case per backend x stage; failures carry the numbers."""
    cases = [("check", b, o) for b in report.backends for o in b.comparison.outputs]
    cases += [("golden", b, o) for b in report.golden for o in b.comparison.outputs]
    if report.oracle is not None:
        cases += [("oracle", report.oracle, o) for o in report.oracle.comparison.outputs]
    audits = [b for b in report.backends if b.audit is not None]
    failures = sum(1 for _, _, o in cases if not o.passed) + sum(1 for b in audits if not b.audit.passed)
    tests = str(len(cases) + len(audits))
    suite = ET.Element("testsuite", name="toolkit check", tests=tests, failures=str(failures), errors="0")
    for kind, backend, output in cases:
        case = ET.SubElement(
            suite, "testcase", classname=f"{kind}.{backend.name}", name=output.name, time=f"{backend.seconds:.6f}"
        )
        if not output.passed:
            against = {
                "golden": "the stored golden outputs",
                "oracle": f"the original checkpoint ({backend.name})",
            }.get(kind, "the float64 oracle")
            numbers = (
                f"max_abs={_err(output.max_abs)} allowed={_err(output.allowed)} "
                f"mean_abs={_err(output.mean_abs)} max_rel={_err(output.max_rel)}"
            )
            failure = ET.SubElement(case, "failure", message=f"{output.reason or 'failed'}; {numbers}")
            failure.text = f"backend {backend.name} ({backend.device}) stage {output.name} vs {against}: {numbers}"
            if kind == "check":
                for localization in report.localizations:
                    if localization.backend == backend.name and localization.stage == output.name:
                        failure.text += "\n" + localization.describe()
    for backend in audits:
        case = ET.SubElement(suite, "testcase", classname=f"audit.{backend.name}", name="every node")
        if not backend.audit.passed:
            failure = ET.SubElement(case, "failure", message=backend.audit.finding.detail)
            failure.text = backend.audit.describe()
    root = ET.Element("testsuites")
    root.append(suite)
    return ET.tostring(root, encoding="unicode", xml_declaration=True)
