"""quantize/convert"""
