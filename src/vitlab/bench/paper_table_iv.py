"""Table IV of the LITv2 / HiLo supplementary (Pan, Cai, Zhuang, "Fast Vision Transformers with HiLo
Attention", NeurIPS 2022): one attention layer of ViT-B's shape (dim 768, 12 heads of 64, a 14x14
token map), each mechanism with its authors' settings for 1/16-scale maps. Params in millions, FLOPs in
millions of multiply-accumulates (MACs, fvcore's convention) for one image, throughput in images/s at batch 64
on an Intel Core i9-10900X CPU and an NVIDIA RTX 3090 GPU. Keys are the attention registry names.
"""

from __future__ import annotations

SETTINGS = dict(dim=768, num_heads=12, hw=(14, 14), batch_size=64,
                cpu="Intel Core i9-10900X @ 3.70GHz", gpu="NVIDIA GeForce RTX 3090")

# name: (paper label, params M, FLOPs (MACs) M, CPU img/s, GPU img/s), in the paper's row order
TABLE_IV: dict[str, tuple[str, float, float, int, int]] = {
    "msa": ("MSA", 2.36, 521.4, 505, 4403),
    "cross_window": ("Cross Window", 2.37, 493.3, 325, 4334),
    "dat": ("DAT", 2.38, 528.7, 223, 3074),
    "performer": ("Performer", 2.36, 617.2, 181, 3180),
    "linformer": ("Linformer", 2.46, 616.6, 518, 4578),
    "sra": ("SRA", 4.72, 419.6, 710, 4810),
    "local_window": ("Local Window", 2.36, 477.2, 631, 4537),
    "shifted_window": ("Shifted Window", 2.36, 477.2, 374, 4351),
    "focal": ("Focal", 2.44, 526.9, 146, 2842),
    "xca": ("XCA", 2.36, 481.7, 583, 4659),
    "quadtree": ("QuadTree", 5.33, 613.3, 72, 3978),
    "van": ("VAN", 1.83, 358.0, 59, 4213),
    "hornet": ("HorNet", 2.23, 436.5, 132, 3996),
    "hilo": ("HiLo", 2.20, 298.3, 1029, 5104),
}


def paper_row(name: str) -> dict | None:
    """Table IV's row for a registry name as a dict, or None when the paper has no such row."""
    if name not in TABLE_IV:
        return None
    label, params_m, mflops, cpu, gpu = TABLE_IV[name]
    return dict(label=label, params_m=params_m, mflops=mflops, cpu_img_per_s=cpu, gpu_img_per_s=gpu)
