"""An image through a colour table, kept in the pixel format Qt paints without converting.

pyqtgraph hands a one-channel image with a colour table to Qt as an Indexed8 QImage. Qt's
raster engine cannot paint that format directly: every paint (a new frame, a hover, a dock
resized) converts it pixel by pixel on the way to the screen, spread over Qt's thread pool,
whose threads then take cores from the model decoding beside the window. Converted once per
new image instead, to 32-bit pixels, each paint is a plain scaled copy.
"""

from __future__ import annotations

import pyqtgraph as pg
from PySide6.QtGui import QImage


class ColourTableImage(pg.ImageItem):  # type: ignore[misc]  # pyqtgraph is untyped
    """A pg.ImageItem whose rendered QImage is 32-bit (see the module docstring)."""

    qimage: QImage | None  # set by pg.ImageItem.render

    def render(self) -> None:
        super().render()
        image = self.qimage
        if image is None or image.format() != QImage.Format.Format_Indexed8:
            return
        opaque = not image.hasAlphaChannel()
        target = QImage.Format.Format_RGB32 if opaque else QImage.Format.Format_ARGB32_Premultiplied
        self.qimage = image.convertToFormat(target)
