"""The symmetric InfoNCE loss against open_clip's ``ClipLoss``; features gathered across two gloo processes carry
gradients (the global loss's gradient); zero-shot weights against open_clip's ``build_zero_shot_classifier``;
recall@k, by image and by group, against a direct count."""

from __future__ import annotations

import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

import vitlab
from vitlab.clip.loss import clip_loss
from vitlab.clip.tokenizer import WordTokenizer
from vitlab.clip.zeroshot import retrieval_metrics, zeroshot_classifier, zeroshot_evaluate

open_clip = pytest.importorskip("open_clip")


def _features(n=8, e=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return F.normalize(torch.randn(n, e, generator=g), dim=-1), F.normalize(torch.randn(n, e, generator=g), dim=-1)


def test_loss_equals_open_clip_and_clips_the_scale():
    img, txt = _features()
    scale = torch.tensor(14.0)
    ours, logs = clip_loss(img, txt, scale)
    torch.testing.assert_close(ours, open_clip.loss.ClipLoss()(img, txt, scale))
    big, _ = clip_loss(img, txt, torch.tensor(500.0))
    torch.testing.assert_close(big, open_clip.loss.ClipLoss()(img, txt, torch.tensor(100.0)))  # at most 100
    assert 0.0 <= logs["i2t_acc"] <= 1.0


def _rank(rank: int, world: int, port: int, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    img, txt = _features()
    rows = slice(rank * 4, rank * 4 + 4)
    mine_img, mine_txt = img[rows].clone().requires_grad_(), txt[rows].clone().requires_grad_()
    scale = torch.tensor(10.0, requires_grad=True)
    loss, _ = clip_loss(mine_img, mine_txt, scale)
    loss.backward()
    out[rank] = (loss.detach(), mine_img.grad, mine_txt.grad, scale.grad)
    dist.destroy_process_group()


@pytest.mark.slow  # two spawned processes import torch and vitlab: over a minute on a busy 2-core machine
def test_gathered_features_carry_gradients_across_two_processes():
    """Each of 2 ranks holds 4 of 8 pairs. Its loss is over its rows against all 8; the all-gather's backward
    sends every rank's gradient to the rank that owns the feature, so W x the owner's gradient is the global
    loss's, and the mean of the ranks' losses (DDP's averaging) is the global loss."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = mp.Manager().dict()
    mp.spawn(_rank, args=(2, port, out), nprocs=2, join=True)
    img, txt = _features()
    img.requires_grad_(), txt.requires_grad_()
    scale = torch.tensor(10.0, requires_grad=True)
    ref, _ = clip_loss(img, txt, scale)
    ref.backward()
    torch.testing.assert_close((out[0][0] + out[1][0]) / 2, ref.detach())
    torch.testing.assert_close(torch.cat([out[0][1], out[1][1]]) / 2, img.grad)
    torch.testing.assert_close(torch.cat([out[0][2], out[1][2]]) / 2, txt.grad)
    torch.testing.assert_close((out[0][3] + out[1][3]) / 2, scale.grad)


def test_zeroshot_classifier_equals_open_clip_and_evaluates():
    model = vitlab.create_model("clip_vit_pico_patch8", text_vocab_size=30).eval()
    tok = WordTokenizer.from_texts(["a photo of the number one two three", "a drawing"], context_length=16)
    names, templates = ["one", "two", "three"], ["a photo of the number {}", "a drawing of {}", "{}"]
    ours = zeroshot_classifier(model, tok, names, templates)
    with torch.no_grad():
        ref = open_clip.zero_shot_classifier.build_zero_shot_classifier(model, tok, names, templates)
    torch.testing.assert_close(ours, ref.T)
    x = torch.randn(6, 1, 32, 32)
    with torch.no_grad():
        y = (model.encode_image(x, normalize=True) @ ours.T).argmax(-1)
    r = zeroshot_evaluate(model, ours, [(x, y)])
    assert r["top1"] == 100.0 and r["num_images"] == 6
    with pytest.raises(ValueError, match="exactly once"):
        zeroshot_classifier(model, tok, names, ["no placeholder"])


def test_retrieval_metrics_by_hand():
    # 3 images, 4 captions (image 0 has two); similarities chosen so every rank is known
    images = torch.eye(3)
    texts = torch.tensor([[1.0, 0.0, 0.0], [0.0, 0.9, 0.1], [0.2, 0.0, 0.8], [0.0, 1.0, 0.0]])
    owner = torch.tensor([0, 0, 2, 1])
    r = retrieval_metrics(images, texts, owner, ks=(1, 2))
    # text->image: t0, t2, t3 find their image first; t1 (image 0) scores (0, .9, .1): image 0 comes last
    assert r["t2i_r1"] == pytest.approx(75.0) and r["t2i_r2"] == pytest.approx(75.0)
    # image->text: img0's best caption t0 is its top text; img1's top text is t3 (its own); img2's is t2
    assert r["i2t_r1"] == pytest.approx(100.0)


def test_retrieval_metrics_match_by_group():
    # 4 images in two groups (the digits demo's classes), one caption per group: a caption matches both images of
    # its group, and an image its group's caption
    images = torch.eye(4)
    texts = torch.tensor([[0.1, 0.9, 0.5, 0.0], [0.8, 0.0, 0.2, 0.1]])
    r = retrieval_metrics(images, texts, torch.tensor([0, 1]), ks=(1, 2), image_group=torch.tensor([0, 0, 1, 1]))
    # text->image: t0's best match (image 1, 0.9) is first; t1's (image 2, 0.2) is behind image 0 (0.8)
    assert (r["t2i_r1"], r["t2i_r2"]) == (50.0, 100.0)
    # image->text: image 0 prefers t1 (0.8 > 0.1), image 2 prefers t0 (0.5 > 0.2); images 1 and 3 are hits
    assert (r["i2t_r1"], r["i2t_r2"]) == (50.0, 100.0)
