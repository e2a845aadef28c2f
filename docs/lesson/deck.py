"""The class's slide deck: one HTML file, made from docs/lesson/src/deck.md.in filled in.

    python docs/lesson/lesson_numbers.py --write     # writes docs/lesson/slides/deck.html with the pages

Why: the lesson's pictures alone are no deck (no title, no objectives, no formulas, no code,
nothing for the parts without a picture), and a deck kept by hand drifts from the code and
the runs. So the deck has a source like every page of the class: docs/lesson/src/deck.md.in,
whose `{{name}}` numbers, timing tables and projected code lesson_numbers.py fills in from the
same runs; this file turns it into HTML. One file, everything inline (style, script, the ten
pictures as data: URLs), so it opens from a laptop's disk on a projector with no network; its
content policy forbids loading anything. The replay pages it links to are the class's own
runs, relative to the checkout (`runs/...`).

The source's markdown, the little of it a slide needs: slides are separated by a line `---`;
`# ` is a slide's title; paragraphs; `- ` and `1. ` lists (a line indented by two spaces
continues an item); `| a | b |` tables; fenced code (```diff colours `+` and `-` lines,
```formula centres large type); an image alone on a line, `![what](01-zero_figure1.png)`,
read from docs/lesson/slides/; inline `code`, **bold**, *emphasis* and [links](url). A line
`Note: ...` starts the slide's speaker notes (the rest of the slide); an image's slide with
no note gets that picture's line from slides/README.md. `{: part=N}` on a line of its own tags
the slide as part N's.

Keys: right, space, page down: next; left, page up: back; home, end; N: the speaker notes;
the address's #number is the slide.
"""
from __future__ import annotations

import base64
import html
import os
import re

HERE = os.path.dirname(os.path.abspath(__file__))
SLIDES = os.path.join(HERE, "slides")
CSP = ("default-src 'none'; img-src data:; style-src 'unsafe-inline'; script-src 'unsafe-inline'; "
       "base-uri 'none'; form-action 'none'")


def inline(text: str) -> str:
    """Inline markdown: `code`, **bold**, *emphasis*, [text](url); everything else escaped."""
    out, pos = [], 0
    for m in re.finditer(r"`([^`]+)`", text):
        out.append(_emphasis(text[pos:m.start()]))
        out.append(f"<code>{html.escape(m.group(1))}</code>")
        pos = m.end()
    out.append(_emphasis(text[pos:]))
    return "".join(out)


def _emphasis(text: str) -> str:
    text = html.escape(text, quote=False)
    text = re.sub(r"\[([^\]]+)\]\(([^)\s]+)\)", lambda m: f'<a href="{html.escape(m.group(2))}">{m.group(1)}</a>',
                  text)
    text = re.sub(r"\*\*([^*]+)\*\*", r"<strong>\1</strong>", text)
    return re.sub(r"(?<![\w*])\*([^*\s][^*]*)\*(?![\w*])", r"<em>\1</em>", text)


def image(name: str, alt: str) -> str:
    with open(os.path.join(SLIDES, name), "rb") as f:
        data = base64.b64encode(f.read()).decode()
    return f'<img alt="{html.escape(alt)}" data-name="{html.escape(name)}" src="data:image/png;base64,{data}">'


def code_block(lang: str, lines: list[str]) -> str:
    if lang == "formula":
        return "<div class=\"formula\">" + "<br>".join(inline(ln) for ln in lines) + "</div>"
    rows = []
    for ln in lines:
        cls = ""
        if lang == "diff" and ln[:1] in "+-" and not ln.startswith(("+++", "---")):
            cls = " class=\"add\"" if ln[0] == "+" else " class=\"del\""
        elif lang == "diff" and ln.startswith(("+++", "---")):
            cls = " class=\"head\""
        rows.append(f"<span{cls}>{html.escape(ln) or ' '}</span>")
    return f'<pre class="code {html.escape(lang)}">' + "".join(rows) + "</pre>"   # each line a block


def table(lines: list[str]) -> str:
    cells = lambda ln: [c.strip() for c in ln.strip().strip("|").split("|")]
    head, body = cells(lines[0]), [cells(ln) for ln in lines[2:]]
    out = ["<table><thead><tr>" + "".join(f"<th>{inline(c)}</th>" for c in head) + "</tr></thead><tbody>"]
    out += ["<tr>" + "".join(f"<td>{inline(c)}</td>" for c in row) + "</tr>" for row in body]
    return "".join(out) + "</tbody></table>"


def slide_html(text: str, notes_by_picture: dict) -> tuple[str, str, str | None]:
    """(the slide's body, its notes, its part) from one slide's markdown."""
    lines = text.strip("\n").splitlines()
    part = None
    notes: list[str] = []
    body: list[str] = []
    i = 0
    pictures = []
    while i < len(lines):
        ln = lines[i]
        tag = re.fullmatch(r"\{: part=(\d+)\}", ln.strip())
        if tag:
            part = tag.group(1)
            i += 1
            continue
        if ln.startswith("Note:"):
            notes = [ln[len("Note:"):].strip()] + [x for x in lines[i + 1:]]
            break
        fence = re.match(r"```(\w*)", ln)
        if fence:
            j = i + 1
            while not lines[j].startswith("```"):
                j += 1
            body.append(code_block(fence.group(1), lines[i + 1:j]))
            i = j + 1
            continue
        if ln.startswith("# "):
            body.append(f"<h1>{inline(ln[2:])}</h1>")
            i += 1
            continue
        if ln.startswith("## "):
            body.append(f"<h2>{inline(ln[3:])}</h2>")
            i += 1
            continue
        picture = re.fullmatch(r"!\[([^\]]*)\]\(([\w.-]+\.png)\)", ln.strip())
        if picture:
            pictures.append(picture.group(2))
            body.append(image(picture.group(2), picture.group(1)))
            i += 1
            continue
        if ln.startswith("|"):
            j = i
            while j < len(lines) and lines[j].startswith("|"):
                j += 1
            body.append(table(lines[i:j]))
            i = j
            continue
        item = re.match(r"(- |\d+\. )", ln)
        if item:
            ordered = item.group(1) != "- "
            items, j = [], i
            while j < len(lines) and re.match(r"(- |\d+\. )", lines[j]):
                text_ = re.sub(r"^(- |\d+\. )", "", lines[j])
                j += 1
                while j < len(lines) and lines[j].startswith("  ") and lines[j].strip():
                    text_ += " " + lines[j].strip()
                    j += 1
                items.append(f"<li>{inline(text_)}</li>")
            tag_ = "ol" if ordered else "ul"
            body.append(f"<{tag_}>{''.join(items)}</{tag_}>")
            i = j
            continue
        if not ln.strip():
            i += 1
            continue
        j = i
        while j < len(lines) and lines[j].strip() and not re.match(r"(#|- |\d+\. |\||```|!\[|Note:|\{:)", lines[j]):
            j += 1
        body.append(f"<p>{inline(' '.join(x.strip() for x in lines[i:j]))}</p>")
        i = j
    if not notes and pictures:
        notes = [notes_by_picture.get(p, "") for p in pictures]
    note_html = "".join(f"<p>{inline(n)}</p>" for n in " ".join(notes).split("\n\n") if n.strip()) if notes else ""
    return "\n".join(body), note_html, part


def picture_notes(slides_readme: str) -> dict:
    """picture file -> its speaker note, from slides/README.md's table."""
    notes = {}
    for m in re.finditer(r"^\| \[\d\d\]\(([\w.-]+\.png)\) \| [^|]* \| \"(.*)\" \|$", slides_readme, flags=re.M):
        notes[m.group(1)] = m.group(2)
    return notes


def build(source: str, slides_readme: str) -> str:
    """The deck's HTML from its source filled in (deck.md.in after lesson_numbers.render,
    without render's header line) and the slides' notes page."""
    notes = picture_notes(slides_readme)
    sections = []
    for n, text in enumerate(re.split(r"^---$", source, flags=re.M), start=1):
        body, note, part = slide_html(text, notes)
        attr = f' data-part="{part}"' if part else ""
        sections.append(f'<section class="slide" id="s{n}"{attr}><div class="body">{body}</div>'
                        f'<aside class="notes">{note}</aside></section>')
    title = re.search(r"^# (.*)$", source, flags=re.M).group(1)
    return PAGE.replace("{{title}}", html.escape(title)).replace("{{csp}}", CSP).replace(
        "{{slides}}", "\n".join(sections))


PAGE = """<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta http-equiv="Content-Security-Policy" content="{{csp}}">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>{{title}}</title>
<!-- Made by `python docs/lesson/lesson_numbers.py --write` from docs/lesson/src/deck.md.in (docs/lesson/deck.py): edit that file. -->
<style>
html, body { margin: 0; height: 100%; background: #222; font-family: "DejaVu Sans", Helvetica, Arial, sans-serif; }
#stage { position: absolute; left: 50%; top: 50%; width: 1280px; height: 720px; transform-origin: 50% 50%; }
.slide { display: none; position: absolute; inset: 0; background: #fff; color: #1a1a1a; box-sizing: border-box;
         padding: 36px 56px 44px; overflow: hidden; }
.slide.current { display: block; }
.body { height: 100%; overflow: hidden; }
h1 { font-size: 34px; margin: 0 0 18px; color: #1f3a68; }
h2 { font-size: 24px; margin: 10px 0; color: #1f3a68; }
p, li { font-size: 21px; line-height: 1.35; margin: 8px 0; }
ul, ol { margin: 6px 0 6px 4px; padding-left: 28px; }
code { font-family: "DejaVu Sans Mono", Menlo, Consolas, monospace; font-size: 0.9em; background: #f1f3f6; padding: 0 3px; }
pre.code { font-family: "DejaVu Sans Mono", Menlo, Consolas, monospace; font-size: 15px; line-height: 1.3;
           background: #f6f8fa; border: 1px solid #d9dee4; padding: 10px 14px; margin: 8px 0; overflow: hidden;
           max-height: 580px; white-space: pre; }
pre.code span { display: block; }
pre.code .add { background: #e3f6e5; color: #0b5d1e; }
pre.code .del { background: #fbe5e5; color: #8a1c1c; }
pre.code .head { color: #555; font-weight: bold; }
.formula { font-family: "DejaVu Serif", Georgia, serif; font-size: 28px; line-height: 1.6; text-align: center;
           margin: 14px 0; }
table { border-collapse: collapse; margin: 10px 0; font-size: 17px; }
th, td { border: 1px solid #c9d0d8; padding: 4px 9px; text-align: left; vertical-align: top; }
th { background: #eef2f7; }
img { display: block; max-width: 100%; max-height: 560px; margin: 6px auto; }
a { color: #1a5fb4; }
.notes { display: none; }
body.with-notes .slide.current .notes { display: block; position: absolute; left: 0; right: 0; bottom: 0;
    max-height: 38%; overflow: auto; background: #fffbe6; border-top: 2px solid #e0c200; padding: 8px 56px;
    font-size: 17px; }
body.with-notes .slide.current .notes p { font-size: 17px; }
#counter { position: fixed; right: 12px; bottom: 8px; color: #bbb; font-size: 14px; }
@media print {
  body { background: #fff; } #stage { position: static; transform: none !important; width: auto; height: auto; }
  .slide { display: block; position: relative; width: 1280px; height: 720px; page-break-after: always; }
  #counter { display: none; }
}
</style>
</head>
<body>
<div id="stage">
{{slides}}
</div>
<div id="counter"></div>
<script>
(function () {
  var slides = Array.prototype.slice.call(document.querySelectorAll(".slide"));
  var stage = document.getElementById("stage");
  var counter = document.getElementById("counter");
  var at = 0;
  function fit() {  // the 1280 x 720 slide, as large as the window allows, centred
    var s = Math.min(window.innerWidth / 1280, window.innerHeight / 720);
    stage.style.transform = "translate(-50%, -50%) scale(" + s + ")";
  }
  function shrink(slide) {  // code too tall for the slide: smaller type, never under 11 px
    var pres = slide.querySelectorAll("pre.code");
    for (var i = 0; i < pres.length; i++) {
      var size = 15;
      while (pres[i].scrollHeight > pres[i].clientHeight + 1 && size > 11) {
        size -= 1; pres[i].style.fontSize = size + "px";
      }
    }
  }
  function show(n) {
    at = Math.max(0, Math.min(slides.length - 1, n));
    slides.forEach(function (s, i) { s.classList.toggle("current", i === at); });
    shrink(slides[at]);
    counter.textContent = (at + 1) + " / " + slides.length;
    if (location.hash !== "#" + (at + 1)) { history.replaceState(null, "", "#" + (at + 1)); }
  }
  document.addEventListener("keydown", function (e) {
    if (e.key === "ArrowRight" || e.key === " " || e.key === "PageDown") { show(at + 1); e.preventDefault(); }
    else if (e.key === "ArrowLeft" || e.key === "PageUp") { show(at - 1); e.preventDefault(); }
    else if (e.key === "Home") { show(0); } else if (e.key === "End") { show(slides.length - 1); }
    else if (e.key === "n" || e.key === "N") { document.body.classList.toggle("with-notes"); }
  });
  var blocked = [];   // what the content policy stopped (it should never have anything to stop)
  document.addEventListener("securitypolicyviolation", function (e) { blocked.push(e.blockedURI); });
  window.addEventListener("resize", fit);
  window.deck = { show: show, at: function () { return at; }, count: slides.length, blocked: blocked };
  fit();
  show((parseInt(location.hash.slice(1), 10) || 1) - 1);
})();
</script>
</body>
</html>
"""
