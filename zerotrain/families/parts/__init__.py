"""Parts that several families share and that are no family themselves (no FAMILY): family modules import
them, and they import no family module (tests/unit/test_layout.py holds both). Like a family, a part is two
halves (parts.declared): its declarations here, which import no torch, and its torch side under
zerotrain/families/runtime/parts/.

- declared: how a family's declarations reach its torch side;
- latents: the VAE codecs (AutoencoderKL; FLUX.2's, of FLUX.2, FLUX.3 and Ideogram 4; Qwen-Image's, of
  Qwen-Image and Krea 2), and on the torch side the latent packing they share;
- flux1: FLUX.1's transformer (Flux and Chroma): Black Forest Labs names, and on the torch side packing, ids
  and kohya LoRAs; and Flux1, FLUX.1 whole (CLIP-L + T5 conditioning, forward arguments, tiny model) for
  FLUX.1-shaped families;
- qwen_image_edit: Qwen-Image-Edit's pipelines, and on the torch side its text encoder reading the condition
  images.

Torch side only (runtime/parts/): keymaps (fusing LoRA factors into another layout's fused layers, BFL's
swapped modulation rows), qwen_vl (the Qwen-VL processor and a caption's rows around its images: Qwen-Image
2.1, FLUX.3, Qwen-Image-Edit) and tiny (the tiny text encoders and tokenizers of the tiny models)."""
