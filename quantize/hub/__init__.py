"""quantize/hub"""
