"""Write real data available offline in the layouts of users' own data (README, *Your own data*).

    python docs/own_data_example.py OUT

* ``OUT/digits_png/hospital{0..4}/class{0,1,2}/{i}.png``: scikit-learn's 8x8 digits of classes
  0-2, scaled to 0-255 and resized (bilinear) to 28x28 greyscale PNGs, one "hospital" per sample
  index mod 5 (for ``--source imagefolder --partition folders``);
* ``OUT/breast_cancer.csv``: scikit-learn's breast-cancer table, 30 feature columns, ``malignant``
  (1 = malignant, the minority class) and ``bank`` (``bank{row index mod 4}``) (for
  ``--source csv --label-col malignant --client-col bank --partition column``).
"""
import csv
import sys
from pathlib import Path

import numpy as np
from PIL import Image
from sklearn.datasets import load_breast_cancer, load_digits


def main(out: Path) -> None:
    d = load_digits()
    for i, (img, y) in enumerate(zip(d.images, d.target)):
        if y > 2:
            continue
        a = (np.asarray(img) * (255 / 16)).round().astype(np.uint8)
        folder = out / "digits_png" / f"hospital{i % 5}" / f"class{y}"
        folder.mkdir(parents=True, exist_ok=True)
        Image.fromarray(a, mode="L").resize((28, 28), Image.BILINEAR).save(folder / f"{i}.png")
    b = load_breast_cancer()
    with open(out / "breast_cancer.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow([n.replace(" ", "_") for n in b.feature_names] + ["malignant", "bank"])
        for i, (row, t) in enumerate(zip(b.data, b.target)):
            w.writerow([f"{v:.6g}" for v in row] + [1 - int(t), f"bank{i % 4}"])


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python docs/own_data_example.py OUT")
    main(Path(sys.argv[1]))
