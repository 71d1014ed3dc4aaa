# Copyright 2026 The dat_hf Authors. All rights reserved.
#
# Licensed under the MIT License (the "License"); you may not use this file except in compliance with the
# License. See the LICENSE file at the root of the dat_hf repository.
"""Image processor of the vision DAT models, on the Pillow/NumPy backend (no torchvision needed).

Steps: channel handling (RGB conversion, or grayscale conversion for 1-channel models), resize to `size`, rescale by
`rescale_factor` (1/255), normalize with `image_mean` / `image_std` -> `pixel_values` `[b, c, height, width]`.
"""

import numpy as np
from transformers.image_processing_backends import PilBackend
from transformers.image_utils import (
    IMAGENET_STANDARD_MEAN,
    IMAGENET_STANDARD_STD,
    ChannelDimension,
    PILImageResampling,
    infer_channel_dimension_format,
)
from transformers.processing_utils import ImagesKwargs, Unpack
from transformers.utils import auto_docstring, is_vision_available

if is_vision_available():
    import PIL.Image

# ITU-R 601-2 luma, the weights of Pillow's "L" conversion
LUMA = np.array([0.299, 0.587, 0.114], dtype=np.float32)


class DATImageProcessorKwargs(ImagesKwargs, total=False):
    r"""
    do_convert_grayscale (`bool`, *optional*):
        Convert every image to one luma channel (for models with `num_channels=1`, e.g. digits). Takes precedence
        over `do_convert_rgb`.
    """

    do_convert_grayscale: bool | None


def to_grayscale(image, input_data_format=None) -> np.ndarray:
    """A PIL image, NumPy array or torch tensor (channels first or last, 1, 3 or 4 channels) -> `[H, W]` array."""
    if is_vision_available() and isinstance(image, PIL.Image.Image):
        if "A" in image.getbands():  # composite transparency onto white, as RGB conversion does
            background = PIL.Image.new("RGBA", image.size, (255, 255, 255, 255))
            image = PIL.Image.alpha_composite(background, image.convert("RGBA"))
        return np.array(image.convert("L"))
    if hasattr(image, "numpy") and not isinstance(image, np.ndarray):
        image = image.detach().cpu().numpy()
    image = np.asarray(image)
    if image.ndim == 2:
        return image
    if image.ndim != 3:
        raise ValueError(f"Expected an image with 2 or 3 dimensions, got shape {image.shape}.")
    if input_data_format is None:
        input_data_format = infer_channel_dimension_format(image, num_channels=(1, 3, 4))
    if input_data_format == ChannelDimension.FIRST:
        image = np.moveaxis(image, 0, -1)
    channels = image.shape[-1]
    if channels == 1:
        return image[..., 0]
    if channels not in (3, 4):
        raise ValueError(f"Cannot convert an image with {channels} channels to grayscale (expected 1, 3 or 4).")
    luma = image[..., :3].astype(np.float32) @ LUMA
    if np.issubdtype(image.dtype, np.integer):
        return np.clip(np.rint(luma), 0, np.iinfo(image.dtype).max).astype(image.dtype)
    return luma.astype(image.dtype)


@auto_docstring(
    custom_intro=r"""
    Image processor for [`DATForImageClassification`] (Pillow/NumPy backend: works without torchvision): RGB or
    grayscale conversion, resize to `size` (bilinear by default), rescale (1/255) and per-channel normalization (one
    value per output channel) -> `pixel_values`. `DATImageProcessor.from_model_config(model.config)` matches a model's
    image size and channels.

    """
)
class DATImageProcessor(PilBackend):

    valid_kwargs = DATImageProcessorKwargs
    model_input_names = ["pixel_values"]
    resample = PILImageResampling.BILINEAR
    image_mean = IMAGENET_STANDARD_MEAN
    image_std = IMAGENET_STANDARD_STD
    size = {"height": 224, "width": 224}
    do_resize = True
    do_rescale = True
    do_normalize = True
    do_convert_rgb = True
    do_convert_grayscale = False

    def __init__(self, **kwargs: Unpack[DATImageProcessorKwargs]):
        super().__init__(**kwargs)

    @classmethod
    def from_model_config(cls, config, image_mean=None, image_std=None, **kwargs):
        """A processor matching a `DATVisionConfig`: its image size, and grayscale or RGB for its channel count."""
        height, width = config.image_hw
        grayscale = config.num_channels == 1
        if config.num_channels not in (1, 3):
            raise ValueError(f"`from_model_config` handles 1 or 3 channels, got `num_channels`={config.num_channels}.")
        defaults = dict(
            size={"height": height, "width": width},
            do_convert_grayscale=grayscale,
            do_convert_rgb=not grayscale,
            image_mean=image_mean if image_mean is not None else ([0.5] if grayscale else IMAGENET_STANDARD_MEAN),
            image_std=image_std if image_std is not None else ([0.5] if grayscale else IMAGENET_STANDARD_STD),
        )
        defaults.update(kwargs)
        return cls(**defaults)

    def process_image(self, image, do_convert_rgb=None, do_convert_grayscale=None, input_data_format=None, **kwargs):
        if do_convert_grayscale:
            image = to_grayscale(image, input_data_format)  # [H, W]: the backend makes it [1, H, W]
            return super().process_image(image, do_convert_rgb=False, input_data_format=None, **kwargs)
        if do_convert_rgb and not (is_vision_available() and isinstance(image, PIL.Image.Image)):
            array = image.detach().cpu().numpy() if hasattr(image, "detach") else np.asarray(image)
            if array.ndim == 2 or (array.ndim == 3 and 1 in (array.shape[0], array.shape[-1])):
                # one-channel arrays -> three identical channels
                gray = to_grayscale(array, input_data_format)
                image, input_data_format = np.repeat(gray[..., None], 3, axis=-1), ChannelDimension.LAST
        return super().process_image(image, do_convert_rgb=do_convert_rgb, input_data_format=input_data_format,
                                     **kwargs)

    def to_dict(self):
        output = super().to_dict()
        auto_map = output.get("auto_map")
        if isinstance(auto_map, dict) and isinstance(auto_map.get("AutoImageProcessor"), str):
            # the backend-keyed form ({"pil": "module.Class"}, read by AutoImageProcessor): with the plain string,
            # pipelines derive a `...VideoProcessor` remote class from it and ask whether to run remote code
            output["auto_map"] = {**auto_map, "AutoImageProcessor": {"pil": auto_map["AutoImageProcessor"]}}
        return output

    def _validate_preprocess_kwargs(self, image_mean=None, image_std=None, do_normalize=None,
                                    do_convert_grayscale=None, do_convert_rgb=None, **kwargs):
        super()._validate_preprocess_kwargs(image_mean=image_mean, image_std=image_std, do_normalize=do_normalize,
                                            **kwargs)
        if do_normalize:
            channels = 1 if do_convert_grayscale else 3 if do_convert_rgb else None
            for name, value in (("image_mean", image_mean), ("image_std", image_std)):
                if channels is not None and isinstance(value, (list, tuple)) and len(value) != channels:
                    raise ValueError(
                        f"`{name}` has {len(value)} values but the images have {channels} channel(s) "
                        f"(do_convert_grayscale={bool(do_convert_grayscale)}, do_convert_rgb={bool(do_convert_rgb)})."
                    )


__all__ = ["DATImageProcessor", "to_grayscale"]
