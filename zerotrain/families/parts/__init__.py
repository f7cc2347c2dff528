"""Parts that several families share and that are no family themselves (no FAMILY): family modules import
them, and they import no family module (tests/unit/test_layout.py holds both).

- latents: the VAE codecs (AutoencoderKL; FLUX.2's, of FLUX.2, FLUX.3 and Ideogram 4; Qwen-Image's, of
  Qwen-Image and Krea 2) and the latent packing they share;
- flux1: FLUX.1's transformer (Flux and Chroma): packing, ids, Black Forest Labs names, kohya LoRAs; and
  Flux1, FLUX.1 whole (CLIP-L + T5 conditioning, forward arguments, tiny model) for FLUX.1-shaped families;
- keymaps: fusing LoRA factors into another layout's fused layers, BFL's swapped modulation rows;
- qwen_vl: the Qwen-VL processor and a caption's rows around its images (Qwen-Image 2.1, FLUX.3,
  Qwen-Image-Edit);
- qwen_image_edit: Qwen-Image-Edit's text encoder reading the condition images."""
