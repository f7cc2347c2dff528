"""Writes examples/tiny-data: 8 small generated images with captions, so that the CPU demo
(examples/tiny-cpu.yaml) trains on real image files on a fresh machine; and examples/tiny-edit-data,
an edit dataset made of them (tiny-edit-cpu.yaml): each target beside a gray copy of its shape
(control/) and a swatch of its colour (swatch/), its caption the edit instruction. Deterministic.

    python examples/make_tiny_data.py
"""

from pathlib import Path

from PIL import Image, ImageDraw

SHAPES = [("red", (220, 40, 40)), ("green", (40, 180, 60)), ("blue", (50, 80, 220)), ("yellow", (230, 200, 40))]
SIZES = [(96, 64), (64, 96), (80, 80), (64, 64)]


def main(folder: Path = Path(__file__).parent / "tiny-data") -> None:
    folder.mkdir(exist_ok=True)
    for n in range(8):
        name, color = SHAPES[n % 4]
        size = SIZES[n // 2 % 4]
        image = Image.new("RGB", size, (245, 245, 240))
        draw = ImageDraw.Draw(image)
        box = (size[0] // 4, size[1] // 4, 3 * size[0] // 4, 3 * size[1] // 4)
        kind = "circle" if n % 2 else "square"
        (draw.ellipse if kind == "circle" else draw.rectangle)(box, fill=color)
        image.save(folder / f"{n:02d}-{name}-{kind}.png")
        (folder / f"{n:02d}-{name}-{kind}.txt").write_text(f"a {name} {kind} on a white background\n")
    edits(folder, folder.parent / "tiny-edit-data")


def edits(source: Path, folder: Path) -> None:
    """targets/ (the images at 64 x 64), control/ (the same shape in gray) and swatch/ (a 64 x 64 square of
    the target's colour), matched by file stem; captions say the edit."""
    for part in ("targets", "control", "swatch"):
        (folder / part).mkdir(parents=True, exist_ok=True)
    for path in sorted(source.glob("*.png")):
        target = Image.open(path).convert("RGB").resize((64, 64))
        name = path.stem.split("-")[1]
        color = dict(SHAPES)[name]
        target.save(folder / "targets" / path.name)
        gray = target.convert("L").convert("RGB")
        gray.save(folder / "control" / path.name)
        Image.new("RGB", (64, 64), color).save(folder / "swatch" / path.name)
        (folder / "targets" / path.with_suffix(".txt").name).write_text(f"paint the shape {name}\n")


if __name__ == "__main__":
    main()
