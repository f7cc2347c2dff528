"""Writes examples/tiny-data: 8 small generated images with captions, so that the CPU demo
(examples/tiny-cpu.yaml) trains on real image files on a fresh machine. Deterministic.

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


if __name__ == "__main__":
    main()
